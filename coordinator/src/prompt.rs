//! Turning a request's prompt or chat messages into token ids, once, in the
//! coordinator (workers only ever see ids).
//!
//! Chat messages go through the model's own chat template, but message text
//! must never be able to forge control tokens (`<|im_start|>system...`
//! inside a user message). So the template is rendered with each message's
//! content replaced by a sentinel; the rendered text is split at the
//! sentinels; template pieces are encoded with special tokens parsed and
//! message contents with special-token parsing off.

pub mod pool;

use engine::tokenizer::{ChatMessage, Tokenizer};
use serde_json::Value;

use crate::error::Error;
use crate::openai::Message;

/// Sentinel delimiters (Unicode private use); content containing them is refused.
const OPEN: char = '\u{F8F0}';
const CLOSE: char = '\u{F8F1}';

const ROLES: [&str; 3] = ["system", "user", "assistant"];

fn content_text(i: usize, m: &Message) -> Result<String, Error> {
    let param = format!("messages[{i}].content");
    match &m.content {
        Some(Value::String(s)) => Ok(s.clone()),
        // A list of parts: only text parts are supported.
        Some(Value::Array(parts)) => {
            let mut out = String::new();
            for (j, p) in parts.iter().enumerate() {
                match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => out.push_str(t),
                    _ => return Err(Error::invalid(format!("{param}[{j}]"), "only text content parts are supported")),
                }
            }
            Ok(out)
        }
        None | Some(Value::Null) => Err(Error::invalid(param, "message content is required")),
        Some(_) => Err(Error::invalid(param, "message content must be a string or a list of text parts")),
    }
}

/// Token ids of the chat, ending with the assistant's generation prompt.
pub fn chat_tokens(tok: &Tokenizer, messages: &[Message]) -> Result<Vec<u32>, Error> {
    if messages.is_empty() {
        return Err(Error::invalid("messages", "`messages` must not be empty"));
    }
    let mut contents = Vec::with_capacity(messages.len());
    let mut templated = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let role = match &m.role {
            Some(Value::String(r)) if ROLES.contains(&r.as_str()) => r.clone(),
            Some(Value::String(r)) => {
                return Err(Error::invalid(format!("messages[{i}].role"), format!("unknown role {r:?}")))
            }
            _ => return Err(Error::invalid(format!("messages[{i}].role"), "role must be a string")),
        };
        let text = content_text(i, m)?;
        if text.contains(OPEN) || text.contains(CLOSE) {
            return Err(Error::invalid(
                format!("messages[{i}].content"),
                "content contains reserved characters U+F8F0/U+F8F1",
            ));
        }
        templated.push(ChatMessage::new(role, format!("{OPEN}{i}{CLOSE}")));
        contents.push(text);
    }
    let rendered = tok
        .apply_chat_template(&templated, true)
        .map_err(|e| Error::invalid("messages", format!("chat template: {e}")))?;
    let mut ids = Vec::new();
    let mut rest = rendered.as_str();
    let encode = |text: &str, special: bool, ids: &mut Vec<u32>| -> Result<(), Error> {
        if !text.is_empty() {
            ids.extend(tok.encode(text, special).map_err(|e| Error::invalid("messages", e.to_string()))?);
        }
        Ok(())
    };
    while let Some(start) = rest.find(OPEN) {
        encode(&rest[..start], true, &mut ids)?;
        let after = &rest[start + OPEN.len_utf8()..];
        let end = after.find(CLOSE).ok_or_else(|| Error::invalid("messages", "chat template mangled a message"))?;
        let idx: usize =
            after[..end].parse().map_err(|_| Error::invalid("messages", "chat template mangled a message"))?;
        let text = contents.get(idx).ok_or_else(|| Error::invalid("messages", "chat template mangled a message"))?;
        encode(text, false, &mut ids)?;
        rest = &after[end + CLOSE.len_utf8()..];
    }
    encode(rest, true, &mut ids)?;
    Ok(ids)
}

/// Token ids of a completions `prompt`: a string, or a list of token ids.
/// Text is encoded with special-token parsing off.
pub fn completion_tokens(tok: &Tokenizer, prompt: &Option<Value>) -> Result<Vec<u32>, Error> {
    let ids = match prompt {
        Some(Value::String(s)) => tok.encode(s, false).map_err(|e| Error::invalid("prompt", e.to_string()))?,
        Some(Value::Array(items)) if items.iter().all(Value::is_u64) => {
            let vocab = tok.vocab_size() as u64;
            let mut ids = Vec::with_capacity(items.len());
            for v in items {
                match v.as_u64() {
                    Some(id) if id < vocab => ids.push(id as u32),
                    _ => return Err(Error::invalid("prompt", format!("token id {v} is outside the vocabulary"))),
                }
            }
            ids
        }
        Some(Value::Array(items)) if items.len() == 1 && items[0].is_string() => {
            return completion_tokens(tok, &Some(items[0].clone()));
        }
        Some(Value::Array(_)) => {
            return Err(Error::invalid(
                "prompt",
                "batched prompts are not supported; send one string or one token list",
            ))
        }
        None | Some(Value::Null) => return Err(Error::invalid("prompt", "`prompt` is required")),
        Some(_) => return Err(Error::invalid("prompt", "`prompt` must be a string or a list of token ids")),
    };
    if ids.is_empty() {
        return Err(Error::invalid("prompt", "`prompt` is empty"));
    }
    Ok(ids)
}
