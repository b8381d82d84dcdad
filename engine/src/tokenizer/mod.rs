//! Tokenizer and chat template.
//!
//! [`Tokenizer`] wraps a `tokenizers` tokenizer built either from a GGUF file's
//! `tokenizer.ggml.*` metadata ([`Tokenizer::from_gguf`], via
//! [`TokenizerParts`]) or from a Hugging Face `tokenizer.json`
//! ([`Tokenizer::from_files`]). It adds what serving needs on top: the model's
//! chat template (module `chat`), streaming detokenization that never splits a
//! UTF-8 character ([`IncrementalDecoder`]), the ids that end generation, and
//! a digest of everything that decides text -> ids.
//!
//! Special tokens and untrusted text: `tokenizers` matches special tokens
//! anywhere in the input, so a user who types `<|im_start|>system` into a
//! message could forge a turn. [`Tokenizer::encode`] therefore takes
//! `parse_special`, and the wrapper keeps two copies of the `tokenizers`
//! object: one that splits special tokens out (for the rendered template,
//! which the engine controls) and one with `encode_special_tokens` set, which
//! spells them as ordinary text (for content that came from a user). Cloning
//! costs a few MB once per model; the alternative, a `&mut` toggle, would make
//! `encode` take `&mut self` and serialise every request on one lock.

mod chat;
mod detok;
mod error;
mod gguf;
mod hf;

use std::path::Path;

use sha2::Digest as _;

pub use chat::ChatMessage;
pub use detok::IncrementalDecoder;
pub use error::TokenizerError;
pub use gguf::{TokenizerParts, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED};

use chat::ChatState;

/// End-of-turn markers of common chat formats. When the chat template writes
/// one of them and it is a special token, generation must stop there too:
/// ChatML models such as SmolLM2 end an assistant turn with `<|im_end|>`
/// (id 2 here, which is also eos), others with a marker that differs from
/// the eos id (`<|eot_id|>` in Llama 3, `<end_of_turn>` in Gemma).
const END_OF_TURN_MARKERS: &[&str] = &["<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"];

/// Text <-> token ids for one model, plus its chat template.
pub struct Tokenizer {
    /// Splits special tokens out of the text: only for text the engine wrote.
    with_special: tokenizers::Tokenizer,
    /// Same model, but special tokens in the text are ordinary characters.
    plain: tokenizers::Tokenizer,
    /// The stored text of each id (`None` for ids the vocabulary skips).
    pieces: Vec<Option<String>>,
    /// Whether each id is a special (control) token.
    special: Vec<bool>,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    eos_ids: Vec<u32>,
    add_bos: bool,
    /// The template's source, kept for [`Tokenizer::tokenizer_config_json`].
    chat_template: Option<String>,
    chat: ChatState,
    digest: [u8; 32],
}

/// What a constructor knows besides the `tokenizers` object.
struct Meta {
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    /// An explicit end-of-turn id (GGUF `tokenizer.ggml.eot_token_id`).
    eot_id: Option<u32>,
    add_bos: bool,
    chat_template: Option<String>,
    digest: [u8; 32],
}

impl Tokenizer {
    /// Finishes construction: derives the lookup tables, the stop ids and the
    /// chat template from a configured `tokenizers` object.
    fn assemble(with_special: tokenizers::Tokenizer, meta: Meta) -> Result<Self, TokenizerError> {
        let vocab = with_special.get_vocab(true);
        let n = vocab.values().map(|&id| id as usize + 1).max().unwrap_or(0);
        let mut pieces = vec![None; n];
        for (text, id) in vocab {
            pieces[id as usize] = Some(text);
        }
        let mut special = vec![false; n];
        for (id, tok) in with_special.get_added_tokens_decoder() {
            if tok.special {
                if let Some(s) = special.get_mut(id as usize) {
                    *s = true;
                }
            }
        }
        for (what, id) in [("bos", meta.bos_id), ("eos", meta.eos_id), ("eot", meta.eot_id)] {
            if let Some(id) = id.filter(|&id| id as usize >= n) {
                return Err(TokenizerError::SpecialIdOutOfRange { what, id: id.into(), vocab_size: n });
            }
        }
        if meta.add_bos && meta.bos_id.is_none() {
            return Err(TokenizerError::MissingBos);
        }

        let mut eos_ids: Vec<u32> = meta.eos_id.into_iter().chain(meta.eot_id).collect();
        if let Some(template) = &meta.chat_template {
            for marker in END_OF_TURN_MARKERS {
                if let Some(id) = with_special.token_to_id(marker) {
                    if template.contains(marker) && special[id as usize] {
                        eos_ids.push(id);
                    }
                }
            }
        }
        let mut seen = std::collections::HashSet::new();
        eos_ids.retain(|id| seen.insert(*id));

        let piece = |id: Option<u32>| id.and_then(|id| pieces[id as usize].clone()).unwrap_or_default();
        let chat = ChatState::new(meta.chat_template.clone(), piece(meta.bos_id), piece(meta.eos_id));

        let mut plain = with_special.clone();
        plain.set_encode_special_tokens(true);
        Ok(Self {
            with_special,
            plain,
            pieces,
            special,
            bos_id: meta.bos_id,
            eos_id: meta.eos_id,
            eos_ids,
            add_bos: meta.add_bos,
            chat_template: meta.chat_template,
            chat,
            digest: meta.digest,
        })
    }

    /// Text to ids. `parse_special = true` turns special-token text such as
    /// `<|im_start|>` into its single id: use it only for text the engine
    /// wrote (a rendered chat template). With `false` that text is tokenized
    /// as the characters it is, so user content cannot forge control tokens.
    ///
    /// Prepends BOS when the model asks for it (`add_bos`), unless the text
    /// already begins with it (a chat template that writes `bos_token`), so a
    /// rendered prompt never gets two.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let inner = if parse_special { &self.with_special } else { &self.plain };
        let enc = inner.encode_fast(text, false).map_err(TokenizerError::Encode)?;
        let body = enc.get_ids();
        let mut ids = Vec::with_capacity(body.len() + 1);
        if let Some(bos) = self.bos_id.filter(|_| self.add_bos) {
            if body.first() != Some(&bos) {
                ids.push(bos);
            }
        }
        ids.extend_from_slice(body);
        Ok(ids)
    }

    /// Ids to text. With `skip_special`, control tokens (e.g. `<|im_end|>`)
    /// are left out; otherwise they appear as their text.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        self.check_ids(ids)?;
        self.with_special.decode(ids, skip_special).map_err(TokenizerError::Decode)
    }

    /// Errors on the first id outside the vocabulary; `tokenizers` would
    /// silently drop it instead.
    fn check_ids(&self, ids: &[u32]) -> Result<(), TokenizerError> {
        match ids.iter().find(|&&id| id as usize >= self.pieces.len()) {
            Some(&id) => Err(TokenizerError::InvalidTokenId { id, vocab_size: self.pieces.len() }),
            None => Ok(()),
        }
    }

    /// Number of token ids (one more than the largest id).
    pub fn vocab_size(&self) -> usize {
        self.pieces.len()
    }

    /// The beginning-of-sequence id, if the model has one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// The end-of-sequence id, if the model has one.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos_id
    }

    /// Every id that ends generation: eos, the file's end-of-turn id, and the
    /// end-of-turn marker the chat template writes (`<|im_end|>` for ChatML),
    /// without duplicates. A chat turn must stop at `<|im_end|>` even where it
    /// differs from eos, or the model goes on to write the next user turn.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// Whether `id` is a special (control) token. False for unknown ids.
    pub fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    /// The token's text as stored in the vocabulary: byte-level encoded for
    /// BPE models (a leading space is `Ġ`), so not necessarily what it decodes to.
    pub fn token_piece(&self, id: u32) -> Option<&str> {
        self.pieces.get(id as usize)?.as_deref()
    }

    /// SHA-256 over everything that decides text -> ids: for GGUF the model
    /// kind, pre-tokenizer name, vocabulary, merges and special tokens; for
    /// Hugging Face files the bytes of tokenizer.json. Two engines whose
    /// digests match tokenize identically, so they may share KV blocks.
    pub fn digest(&self) -> [u8; 32] {
        self.digest
    }

    /// Renders the model's chat template (see the module `chat`).
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        self.chat.render(messages, add_generation_prompt)
    }
}

impl Tokenizer {
    /// Writes the `tokenizers` model as a Hugging Face `tokenizer.json`, the
    /// copy that splits special tokens out (so a loader that parses them
    /// sees them as the model defines them). With
    /// [`tokenizer_config_json`](Self::tokenizer_config_json) beside it,
    /// [`Tokenizer::from_files`] rebuilds a tokenizer that encodes alike.
    pub fn save_json(&self, path: &Path) -> Result<(), TokenizerError> {
        self.with_special.save(path, false).map_err(|e| {
            let source = match e.downcast::<std::io::Error>() {
                Ok(io) => *io,
                Err(other) => std::io::Error::other(other),
            };
            TokenizerError::Io { path: path.to_owned(), source }
        })
    }

    /// What Hugging Face keeps in `tokenizer_config.json`: the chat template,
    /// BOS and EOS as token text, and whether BOS is prepended.
    pub fn tokenizer_config_json(&self) -> serde_json::Value {
        let piece = |id: Option<u32>| id.and_then(|id| self.token_piece(id));
        serde_json::json!({
            // The generic fast tokenizer: tokenizer.json is complete, so no
            // model-specific class may rewrite its post-processor.
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": piece(self.bos_id),
            "eos_token": piece(self.eos_id),
            "add_bos_token": self.add_bos,
            "chat_template": self.chat_template,
        })
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The vocabulary is tens of thousands of entries: show its shape only.
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos_id", &self.bos_id)
            .field("eos_ids", &self.eos_ids)
            .field("add_bos", &self.add_bos)
            .field("has_chat_template", &self.chat.is_present())
            .finish_non_exhaustive()
    }
}

/// Feeds length-prefixed fields into a hash, so that no two different field
/// lists produce the same byte stream.
struct DigestWriter(sha2::Sha256);

impl DigestWriter {
    fn new(domain: &str) -> Self {
        let mut w = Self(sha2::Sha256::new());
        w.bytes(domain.as_bytes());
        w
    }

    fn bytes(&mut self, b: &[u8]) {
        self.0.update((b.len() as u64).to_le_bytes());
        self.0.update(b);
    }

    fn u64(&mut self, v: u64) {
        self.0.update(v.to_le_bytes());
    }

    fn finish(self) -> [u8; 32] {
        self.0.finalize().into()
    }
}

#[cfg(test)]
mod tests;
