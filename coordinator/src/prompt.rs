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

/// Sentinel delimiters (Unicode private use); content containing them is refused.
const OPEN: char = '\u{F8F0}';
const CLOSE: char = '\u{F8F1}';

/// The roles a message may have.
pub const ROLES: [&str; 3] = ["system", "user", "assistant"];

/// Message fields of OpenAI's that tandem does not implement; each is refused
/// unless null or empty (README: "Request fields").
const UNIMPLEMENTED_MESSAGE_FIELDS: [&str; 6] =
    ["name", "tool_calls", "tool_call_id", "function_call", "audio", "refusal"];

/// A request's prompt, validated by its frontend and not yet tokenized: the one
/// shape both APIs build (HTTP from its JSON, gRPC from its message).
#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    /// Text, encoded with special-token parsing off.
    Text(String),
    /// Chat turns (the chat template is applied).
    Chat(Vec<Turn>),
    /// Token ids already checked against the vocabulary.
    Ids(Vec<u32>),
}

/// One chat message: a known role and its text, free of the template's sentinels.
#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    role: &'static str,
    content: String,
}

impl Turn {
    /// Message `i` (for the field names of errors): `role` one of [`ROLES`].
    pub fn new(i: usize, role: &str, content: String) -> Result<Turn, Error> {
        let role = ROLES
            .into_iter()
            .find(|r| *r == role)
            .ok_or_else(|| Error::invalid(format!("messages[{i}].role"), format!("unknown role {role:?}")))?;
        if content.contains(OPEN) || content.contains(CLOSE) {
            return Err(Error::invalid(
                format!("messages[{i}].content"),
                "content contains reserved characters U+F8F0/U+F8F1",
            ));
        }
        Ok(Turn { role, content })
    }

    /// One message of an OpenAI `messages` list: an object with `role` and `content`
    /// (a string or a list of text parts).
    fn from_json(i: usize, m: &Value) -> Result<Turn, Error> {
        let Value::Object(fields) = m else {
            return Err(Error::invalid(
                format!("messages[{i}]"),
                "a message must be an object with `role` and `content`",
            ));
        };
        for (k, v) in fields {
            if k == "role" || k == "content" {
                continue;
            }
            let param = format!("messages[{i}].{k}");
            if UNIMPLEMENTED_MESSAGE_FIELDS.contains(&k.as_str()) {
                if !asks_nothing(v) {
                    return Err(Error::Unsupported { message: format!("`{param}` is not supported by tandem"), param });
                }
            } else {
                return Err(Error::Unsupported { message: format!("`{param}` is not a known message field"), param });
            }
        }
        let role = match fields.get("role") {
            Some(Value::String(r)) => r.as_str(),
            _ => return Err(Error::invalid(format!("messages[{i}].role"), "role must be a string")),
        };
        Turn::new(i, role, content_text(i, fields.get("content"))?)
    }
}

/// Null, or an empty string, list or object: a field set to ask for nothing.
fn asks_nothing(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        Value::Bool(_) | Value::Number(_) => false,
    }
}

fn content_text(i: usize, content: Option<&Value>) -> Result<String, Error> {
    let param = format!("messages[{i}].content");
    match content {
        Some(Value::String(s)) => Ok(s.clone()),
        // A list of parts: only text parts are supported.
        Some(Value::Array(parts)) => {
            let mut out = String::new();
            for (j, p) in parts.iter().enumerate() {
                match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => out.push_str(t),
                    _ => {
                        return Err(Error::Unsupported {
                            param: format!("{param}[{j}]"),
                            message: format!("`{param}[{j}]`: only text content parts are supported"),
                        })
                    }
                }
            }
            Ok(out)
        }
        None | Some(Value::Null) => Err(Error::invalid(param, "message content is required")),
        Some(_) => Err(Error::invalid(param, "message content must be a string or a list of text parts")),
    }
}

/// The chat API's `messages`: a non-empty list of message objects.
pub fn chat_input(messages: Option<&Value>) -> Result<PromptInput, Error> {
    let list = match messages {
        Some(Value::Array(list)) => list,
        None | Some(Value::Null) => return Err(Error::invalid("messages", "`messages` is required")),
        Some(_) => return Err(Error::invalid("messages", "`messages` must be a list of message objects")),
    };
    if list.is_empty() {
        return Err(Error::invalid("messages", "`messages` must not be empty"));
    }
    let turns = list.iter().enumerate().map(|(i, m)| Turn::from_json(i, m)).collect::<Result<_, _>>()?;
    Ok(PromptInput::Chat(turns))
}

/// The completions API's `prompt`: a string, a list of token ids, or a list of one string.
/// `vocab` bounds the ids.
pub fn completion_input(prompt: Option<&Value>, vocab: usize) -> Result<PromptInput, Error> {
    match prompt {
        Some(Value::String(s)) => Ok(PromptInput::Text(s.clone())),
        Some(Value::Array(items)) if !items.is_empty() && items.iter().all(Value::is_u64) => {
            let ids: Vec<u32> =
                items.iter().filter_map(Value::as_u64).map(|id| id.min(u64::from(u32::MAX)) as u32).collect();
            checked_ids("prompt", &ids, vocab).map(PromptInput::Ids)
        }
        Some(Value::Array(items)) if items.len() == 1 && items[0].is_string() => completion_input(items.first(), vocab),
        Some(Value::Array(items)) if items.is_empty() => Err(Error::invalid("prompt", "`prompt` is empty")),
        Some(Value::Array(_)) => Err(Error::Unsupported {
            param: "prompt".into(),
            message: "batched prompts are not supported; send one string or one token list".into(),
        }),
        None | Some(Value::Null) => Err(Error::invalid("prompt", "`prompt` is required")),
        Some(_) => Err(Error::invalid("prompt", "`prompt` must be a string or a list of token ids")),
    }
}

/// Token ids given as ids (`param`: the field): non-empty, each in the vocabulary.
pub fn checked_ids(param: &str, ids: &[u32], vocab: usize) -> Result<Vec<u32>, Error> {
    if ids.is_empty() {
        return Err(Error::invalid(param, format!("`{param}` is empty")));
    }
    if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(Error::invalid(param, format!("token id {bad} is outside the vocabulary")));
    }
    Ok(ids.to_vec())
}

/// The prompt's token ids (`param`: the field it came in, for errors).
pub fn tokens(tok: &Tokenizer, input: &PromptInput, param: &str) -> Result<Vec<u32>, Error> {
    let ids = match input {
        PromptInput::Ids(ids) => return Ok(ids.clone()),
        PromptInput::Chat(turns) => return chat_tokens(tok, turns),
        PromptInput::Text(text) => tok.encode(text, false).map_err(|e| Error::invalid(param, e.to_string()))?,
    };
    if ids.is_empty() {
        return Err(Error::invalid(param, format!("`{param}` is empty")));
    }
    Ok(ids)
}

/// Token ids of the chat, ending with the assistant's generation prompt.
fn chat_tokens(tok: &Tokenizer, turns: &[Turn]) -> Result<Vec<u32>, Error> {
    if turns.is_empty() {
        return Err(Error::invalid("messages", "`messages` must not be empty"));
    }
    let templated: Vec<ChatMessage> =
        (0..turns.len()).zip(turns).map(|(i, t)| ChatMessage::new(t.role, format!("{OPEN}{i}{CLOSE}"))).collect();
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
        let turn = turns.get(idx).ok_or_else(|| Error::invalid("messages", "chat template mangled a message"))?;
        encode(&turn.content, false, &mut ids)?;
        rest = &after[end + CLOSE.len_utf8()..];
    }
    encode(rest, true, &mut ids)?;
    Ok(ids)
}
