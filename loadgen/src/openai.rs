//! Reading OpenAI-shaped bodies leniently: stream chunks, whole responses
//! and error bodies of both endpoints, from any server. Anything missing or
//! of the wrong type reads as absent; only a body that is not JSON at all is
//! an error.

use serde_json::Value;

/// `{"error": {...}}`, or `{"error": "text"}` as some servers send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorBody {
    /// `error.code`, a string or a number (llama-server sends the HTTP status).
    pub code: Option<String>,
    pub message: String,
}

/// What one stream chunk (or a whole response) carries that we measure.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Delta {
    /// `choices[0].text` (completions) or `.delta.content` / `.message.content` (chat).
    pub content: Option<String>,
    pub finish_reason: Option<String>,
    pub prompt_tokens: Option<u32>,
    pub completion_tokens: Option<u32>,
    /// `usage.prompt_tokens_details.cached_tokens`: prompt tokens the server
    /// took from its prefix cache.
    pub cached_tokens: Option<u32>,
}

/// One SSE data payload, read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Chunk {
    /// `[DONE]`.
    Done,
    /// A JSON object with an `error`.
    Error(ErrorBody),
    Data(Delta),
}

/// Reads an SSE event's data. An `event: error` without an OpenAI error
/// body still reads as an error, its data as the message.
pub fn read_event(event: Option<&str>, data: &str) -> Result<Chunk, String> {
    if data.trim() == "[DONE]" {
        return Ok(Chunk::Done);
    }
    let v: Value = match serde_json::from_str(data) {
        Ok(v) => v,
        Err(_) if event == Some("error") => return Ok(Chunk::Error(ErrorBody { code: None, message: data.into() })),
        Err(e) => return Err(format!("an SSE data line is not JSON ({e}): {}", clip(data))),
    };
    if let Some(e) = error_of(&v) {
        return Ok(Chunk::Error(e));
    }
    if event == Some("error") {
        return Ok(Chunk::Error(ErrorBody { code: None, message: data.into() }));
    }
    Ok(Chunk::Data(delta_of(&v)))
}

/// Reads a whole (non-streaming) response body.
pub fn read_response(body: &[u8]) -> Result<Chunk, String> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| format!("the response is not JSON ({e}): {}", clip(&String::from_utf8_lossy(body))))?;
    Ok(match error_of(&v) {
        Some(e) => Chunk::Error(e),
        None => Chunk::Data(delta_of(&v)),
    })
}

/// Reads an error response body; a body in no known shape becomes the message.
pub fn read_error(body: &[u8]) -> ErrorBody {
    serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| error_of(&v))
        .unwrap_or_else(|| ErrorBody { code: None, message: clip(&String::from_utf8_lossy(body)) })
}

fn error_of(v: &Value) -> Option<ErrorBody> {
    match v.get("error")? {
        Value::Null => None,
        Value::String(s) => Some(ErrorBody { code: None, message: s.clone() }),
        e => Some(ErrorBody {
            code: match e.get("code") {
                Some(Value::String(s)) => Some(s.clone()),
                Some(Value::Number(n)) => Some(n.to_string()),
                _ => None,
            },
            message: e.get("message").and_then(Value::as_str).unwrap_or_default().to_owned(),
        }),
    }
}

fn delta_of(v: &Value) -> Delta {
    let choice = &v["choices"][0];
    let content = [&choice["text"], &choice["delta"]["content"], &choice["message"]["content"]]
        .into_iter()
        .find_map(Value::as_str)
        .map(str::to_owned);
    let count = |n: &Value| n.as_u64().map(|n| u32::try_from(n).unwrap_or(u32::MAX));
    let usage = &v["usage"];
    Delta {
        content,
        finish_reason: choice["finish_reason"].as_str().map(str::to_owned),
        prompt_tokens: count(&usage["prompt_tokens"]),
        completion_tokens: count(&usage["completion_tokens"]),
        cached_tokens: count(&usage["prompt_tokens_details"]["cached_tokens"]),
    }
}

/// At most 200 characters of server text in a message.
fn clip(s: &str) -> String {
    match s.char_indices().nth(200) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(json: &str) -> Delta {
        match read_event(None, json) {
            Ok(Chunk::Data(d)) => d,
            other => panic!("{json}: {other:?}"),
        }
    }

    #[test]
    fn content_of_both_endpoints() {
        assert_eq!(data(r#"{"choices":[{"text":" a","finish_reason":null}]}"#).content.as_deref(), Some(" a"));
        assert_eq!(data(r#"{"choices":[{"delta":{"content":"b"}}]}"#).content.as_deref(), Some("b"));
        assert_eq!(data(r#"{"choices":[{"delta":{"role":"assistant"}}]}"#).content, None);
        let last = data(r#"{"choices":[],"usage":{"prompt_tokens":235,"completion_tokens":64}}"#);
        assert_eq!((last.content, last.prompt_tokens, last.completion_tokens), (None, Some(235), Some(64)));
        assert_eq!(last.cached_tokens, None);
        let cached =
            data(r#"{"choices":[],"usage":{"prompt_tokens":235,"prompt_tokens_details":{"cached_tokens":224}}}"#);
        assert_eq!(cached.cached_tokens, Some(224));
        let fin = data(r#"{"choices":[{"text":"","finish_reason":"length"}]}"#);
        assert_eq!(fin.finish_reason.as_deref(), Some("length"));
        assert_eq!(read_event(None, "[DONE]"), Ok(Chunk::Done));
    }

    #[test]
    fn errors_with_string_number_or_no_code() {
        let e = |json: &str| read_event(None, json);
        assert_eq!(
            e(r#"{"error":{"message":"late","type":"timeout_error","code":"deadline_exceeded"}}"#),
            Ok(Chunk::Error(ErrorBody { code: Some("deadline_exceeded".into()), message: "late".into() }))
        );
        assert_eq!(
            e(r#"{"error":{"code":500,"message":"boom"}}"#),
            Ok(Chunk::Error(ErrorBody { code: Some("500".into()), message: "boom".into() }))
        );
        assert_eq!(e(r#"{"error":"x"}"#), Ok(Chunk::Error(ErrorBody { code: None, message: "x".into() })));
        assert_eq!(
            read_event(Some("error"), "gone"),
            Ok(Chunk::Error(ErrorBody { code: None, message: "gone".into() }))
        );
        assert!(e("{not json").is_err());
        assert_eq!(read_error(b"<html>"), ErrorBody { code: None, message: "<html>".into() });
    }

    #[test]
    fn wrong_types_read_as_absent() {
        let d = data(r#"{"choices":{"text":1},"usage":{"completion_tokens":-3}}"#);
        assert_eq!(d, Delta::default());
        assert_eq!(data("[]"), Delta::default());
        assert_eq!(data(r#"{"usage":{"completion_tokens":99999999999}}"#).completion_tokens, Some(u32::MAX));
    }
}
