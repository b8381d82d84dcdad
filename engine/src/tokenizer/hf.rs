//! Building the tokenizer from Hugging Face files (safetensors models).
//!
//! `tokenizer.json` is complete for text -> ids; `tokenizer_config.json`
//! adds what serving needs besides: the chat template and which tokens are
//! BOS and EOS. The post-processor in tokenizer.json (which would add BOS)
//! is never run: [`Tokenizer::encode`] adds BOS itself, so both model
//! sources behave alike and a rendered chat prompt never gets two.

use std::path::Path;

use serde_json::Value;

use super::{DigestWriter, Meta, Tokenizer, TokenizerError};

impl Tokenizer {
    /// Loads `tokenizer.json`, and the chat template, BOS/EOS tokens and
    /// `add_bos_token` from `tokenizer_config.json` when given.
    ///
    /// Without a config, or when it does not say `add_bos_token`, BOS is
    /// added exactly when tokenizer.json's post-processor would add it; with
    /// no config that token is also taken as the BOS id.
    pub fn from_files(tokenizer_json: &Path, tokenizer_config_json: Option<&Path>) -> Result<Self, TokenizerError> {
        let bytes = read(tokenizer_json)?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| TokenizerError::BadFile { path: tokenizer_json.to_owned(), why: e.to_string() })?;
        let mut digest = DigestWriter::new("tandem-tokenizer-json/v1");
        digest.bytes(&bytes);
        let digest = digest.finish();

        // What the post-processor puts in front of an empty text: BOS, if anything.
        let probe = inner.encode_fast("", true).map_err(TokenizerError::Encode)?;
        let leading = probe.get_ids().first().copied();

        let meta = match tokenizer_config_json {
            None => {
                let bos_id = leading.filter(|&id| inner.get_added_tokens_decoder().get(&id).is_some_and(|t| t.special));
                Meta { bos_id, eos_id: None, eot_id: None, add_bos: bos_id.is_some(), chat_template: None, digest }
            }
            Some(path) => {
                let config = Config::read(path)?;
                let bos_id = config.token_id(&inner, "bos_token")?;
                let add_bos = match config.get("add_bos_token") {
                    None | Some(Value::Null) => bos_id.is_some() && leading == bos_id,
                    Some(Value::Bool(b)) => *b,
                    Some(_) => return Err(config.bad("add_bos_token is not a bool")),
                };
                Meta {
                    bos_id,
                    eos_id: config.token_id(&inner, "eos_token")?,
                    eot_id: None,
                    add_bos,
                    chat_template: config.chat_template()?,
                    digest,
                }
            }
        };
        Tokenizer::assemble(inner, meta)
    }
}

fn read(path: &Path) -> Result<Vec<u8>, TokenizerError> {
    std::fs::read(path).map_err(|source| TokenizerError::Io { path: path.to_owned(), source })
}

/// tokenizer_config.json, parsed loosely: its schema varies by model and
/// transformers version, so only the keys used here are checked.
struct Config<'a> {
    path: &'a Path,
    json: serde_json::Map<String, Value>,
}

impl<'a> Config<'a> {
    fn read(path: &'a Path) -> Result<Self, TokenizerError> {
        let bytes = read(path)?;
        let bad = |why: String| TokenizerError::BadFile { path: path.to_owned(), why };
        match serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()))? {
            Value::Object(json) => Ok(Self { path, json }),
            _ => Err(bad("not a JSON object".to_owned())),
        }
    }

    fn get(&self, key: &str) -> Option<&Value> {
        self.json.get(key)
    }

    fn bad(&self, why: &str) -> TokenizerError {
        TokenizerError::BadFile { path: self.path.to_owned(), why: why.to_owned() }
    }

    /// A special token given as `"<s>"` or `{"content": "<s>", ...}`, as an id.
    fn token_id(&self, inner: &tokenizers::Tokenizer, key: &'static str) -> Result<Option<u32>, TokenizerError> {
        let text = match self.get(key) {
            None | Some(Value::Null) => return Ok(None),
            Some(Value::String(s)) => s.as_str(),
            Some(Value::Object(o)) => match o.get("content") {
                Some(Value::String(s)) => s.as_str(),
                _ => return Err(self.bad(&format!("{key} has no string \"content\""))),
            },
            Some(_) => return Err(self.bad(&format!("{key} is not a string or object"))),
        };
        inner
            .token_to_id(text)
            .map(Some)
            .ok_or_else(|| TokenizerError::UnknownSpecialToken { what: key, token: text.to_owned() })
    }

    /// `chat_template`: a string, or a list of `{name, template}` of which
    /// the one named "default" is the chat template.
    fn chat_template(&self) -> Result<Option<String>, TokenizerError> {
        match self.get("chat_template") {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(Value::Array(list)) => Ok(list.iter().find_map(|entry| {
                let name = entry.get("name")?.as_str()?;
                let template = entry.get("template")?.as_str()?;
                (name == "default").then(|| template.to_owned())
            })),
            Some(_) => Err(self.bad("chat_template is not a string or list")),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use serde_json::json;

    use super::*;
    use crate::tokenizer::tests::tiny;

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    /// A scratch directory holding tokenizer.json (the tiny tokenizer, with
    /// `edit` applied to its JSON) and, when given, tokenizer_config.json.
    struct Files {
        dir: PathBuf,
    }

    impl Files {
        fn new(
            name: &str,
            edit: impl FnOnce(&mut Value),
            config: Option<Value>,
        ) -> Result<Self, Box<dyn std::error::Error>> {
            let dir = std::env::temp_dir().join(format!("tandem-tok-{}-{name}", std::process::id()));
            std::fs::create_dir_all(&dir)?;
            let mut json = serde_json::to_value(&tiny()?.with_special)?;
            edit(&mut json);
            std::fs::write(dir.join("tokenizer.json"), serde_json::to_vec(&json)?)?;
            if let Some(config) = config {
                std::fs::write(dir.join("tokenizer_config.json"), serde_json::to_vec(&config)?)?;
            }
            Ok(Self { dir })
        }

        fn load(&self, with_config: bool) -> Result<Tokenizer, TokenizerError> {
            let config = self.dir.join("tokenizer_config.json");
            Tokenizer::from_files(&self.dir.join("tokenizer.json"), with_config.then_some(config.as_path()))
        }
    }

    impl Drop for Files {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    #[test]
    fn config_supplies_template_bos_and_eos() -> TestResult {
        let config = json!({
            "bos_token": {"content": "<|im_start|>", "special": true},
            "eos_token": "<|endoftext|>",
            "add_bos_token": true,
            "chat_template": "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}",
        });
        let files = Files::new("config", |_| {}, Some(config))?;
        let tok = files.load(true)?;
        let reference = tiny()?;
        assert_eq!((tok.bos_id(), tok.eos_id()), (Some(1), Some(0)));
        assert_eq!(tok.eos_ids(), [0, 2]);
        assert_eq!(tok.vocab_size(), reference.vocab_size());
        assert_eq!(tok.encode("hello", false)?, [1, reference.encode("hello", false)?[0]]);
        assert!(tok.is_special(2) && !tok.is_special(3));
        let prompt = tok.apply_chat_template(&[crate::tokenizer::ChatMessage::new("user", "hi")], true)?;
        assert_eq!(prompt, "<|im_start|>hi<|im_end|>");
        // The digest is the file's, stable across loads.
        assert_eq!(files.load(true)?.digest(), tok.digest());
        assert_ne!(tok.digest(), reference.digest());
        Ok(())
    }

    #[test]
    fn without_config_bos_follows_the_post_processor() -> TestResult {
        let add_bos = |j: &mut Value| {
            j["post_processor"] = json!({
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}},
            });
        };
        let files = Files::new("postproc", add_bos, None)?;
        let tok = files.load(false)?;
        assert_eq!(tok.bos_id(), Some(1));
        assert_eq!(tok.encode("hello", false)?.first(), Some(&1));
        assert!(matches!(tok.apply_chat_template(&[], true), Err(TokenizerError::NoChatTemplate)));

        let plain = Files::new("plain", |_| {}, None)?.load(false)?;
        assert_eq!((plain.bos_id(), plain.eos_id()), (None, None));
        assert_eq!(plain.encode("hello", false)?.len(), 1);
        Ok(())
    }

    #[test]
    fn template_list_picks_default() -> TestResult {
        let config = json!({"chat_template": [
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "chat"},
        ]});
        let tok = Files::new("list", |_| {}, Some(config))?.load(true)?;
        assert_eq!(tok.apply_chat_template(&[], false)?, "chat");
        Ok(())
    }

    #[test]
    fn bad_files_are_typed_errors() -> TestResult {
        let unknown = Files::new("unknown", |_| {}, Some(json!({"eos_token": "</s>"})))?;
        assert!(matches!(unknown.load(true), Err(TokenizerError::UnknownSpecialToken { what: "eos_token", .. })));
        let not_bool = Files::new("notbool", |_| {}, Some(json!({"add_bos_token": "yes"})))?;
        assert!(matches!(not_bool.load(true), Err(TokenizerError::BadFile { .. })));
        let broken = Files::new("broken", |j| *j = json!({"model": 3}), None)?;
        assert!(matches!(broken.load(false), Err(TokenizerError::BadFile { .. })));
        let missing = Tokenizer::from_files(Path::new("/nonexistent/tokenizer.json"), None);
        assert!(matches!(missing, Err(TokenizerError::Io { .. })));
        Ok(())
    }
}
