//! Building the tokenizer from a GGUF file's `tokenizer.ggml.*` metadata.
//!
//! GGUF stores the vocabulary, not a `tokenizer.json`: the token texts in id
//! order, a token type per id, the BPE merges as "left right" strings, and
//! the *name* of the pre-tokenizer (`tokenizer.ggml.pre`), whose regexes live
//! in llama.cpp's source. So each supported name is mapped here to the
//! `tokenizers` pre-tokenizer that splits text the same way; an unknown name
//! is an error rather than a guess, because a wrong split still produces
//! plausible ids and the model then quietly answers worse.
//!
//! The metadata is first read into [`TokenizerParts`], plain data that tests
//! (and a future loader for other containers) can build or modify directly.

use std::collections::HashSet;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, PreTokenizerWrapper};

use super::{DigestWriter, Meta, Tokenizer, TokenizerError};
use crate::gguf::{GgufError, GgufFile};

/// GGUF token type of a control token (`<|im_start|>`): matched in text only
/// when special tokens are parsed, left out of decoded output on request.
pub const TOKEN_TYPE_CONTROL: i32 = 3;
/// GGUF token type of a user-defined token: ordinary vocabulary that must be
/// matched as a whole wherever it appears (llama.cpp does so regardless of
/// `parse_special`, and so does this tokenizer).
pub const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// A tokenizer's definition as plain data, as GGUF stores it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizerParts {
    /// `tokenizer.ggml.model`; only "gpt2" (byte-level BPE) is supported.
    pub model: String,
    /// `tokenizer.ggml.pre`: "smollm", "gpt2" or "default".
    pub pre: String,
    /// Token texts; the index is the id.
    pub tokens: Vec<String>,
    /// GGUF token type per token (1 normal, 3 control, 4 user-defined, ...),
    /// or empty when the file has none (all normal).
    pub token_types: Vec<i32>,
    /// Merge rules in priority order, each "left right".
    pub merges: Vec<String>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    /// End-of-turn id, when the file names one apart from eos.
    pub eot_id: Option<u32>,
    /// Whether `encode` prepends BOS.
    pub add_bos: bool,
    /// The Jinja chat template, if the file has one.
    pub chat_template: Option<String>,
}

impl TokenizerParts {
    /// Reads the `tokenizer.ggml.*` and `tokenizer.chat_template` keys.
    pub fn from_gguf(f: &GgufFile) -> Result<Self, TokenizerError> {
        let model = f.require_str("tokenizer.ggml.model")?.to_owned();
        // Checked before the large arrays are copied out.
        if model != "gpt2" {
            return Err(TokenizerError::UnsupportedModel(model));
        }
        let pre = match f.meta("tokenizer.ggml.pre") {
            // llama.cpp's own default when the key is absent (older files).
            None => "default".to_owned(),
            Some(_) => f.require_str("tokenizer.ggml.pre")?.to_owned(),
        };
        let token_types = match f.meta("tokenizer.ggml.token_type") {
            None => Vec::new(),
            Some(_) => f
                .i64_array("tokenizer.ggml.token_type")?
                .into_iter()
                .map(|t| {
                    i32::try_from(t).map_err(|_| GgufError::Metadata {
                        key: "tokenizer.ggml.token_type".to_owned(),
                        why: format!("token type {t} out of range"),
                    })
                })
                .collect::<Result<_, _>>()?,
        };
        let chat_template = match f.meta("tokenizer.chat_template") {
            None => None,
            Some(_) => Some(f.require_str("tokenizer.chat_template")?.to_owned()),
        };
        Ok(Self {
            model,
            pre,
            tokens: f.str_array("tokenizer.ggml.tokens")?,
            token_types,
            merges: f.str_array("tokenizer.ggml.merges")?,
            bos_id: opt_id(f, "tokenizer.ggml.bos_token_id")?,
            eos_id: opt_id(f, "tokenizer.ggml.eos_token_id")?,
            eot_id: opt_id(f, "tokenizer.ggml.eot_token_id")?,
            add_bos: opt_bool(f, "tokenizer.ggml.add_bos_token")?.unwrap_or(false),
            chat_template,
        })
    }

    /// The pre-tokenizer llama.cpp uses for `self.pre`.
    fn pre_tokenizer(&self) -> Result<PreTokenizerWrapper, TokenizerError> {
        // GPT-2's regex split, bytes mapped to printable characters.
        let byte_level = ByteLevel::new(false, true, true);
        match self.pre.as_str() {
            "gpt2" | "default" => Ok(byte_level.into()),
            // llama.cpp: "\p{N}" first (every digit alone), then GPT-2's regex.
            "smollm" => Ok(Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into()),
            other => Err(TokenizerError::UnsupportedPreTokenizer(other.to_owned())),
        }
    }

    /// The merges as pairs, split on the first space (byte-level tokens hold
    /// no literal space: it is spelled `Ġ`). A repeated pair keeps its first,
    /// higher priority, as in llama.cpp.
    fn merge_pairs(&self) -> Result<Vec<(String, String)>, TokenizerError> {
        let mut seen = HashSet::with_capacity(self.merges.len());
        let mut pairs = Vec::with_capacity(self.merges.len());
        for (index, merge) in self.merges.iter().enumerate() {
            let (a, b) = merge
                .split_once(' ')
                .filter(|(a, b)| !a.is_empty() && !b.is_empty())
                .ok_or_else(|| TokenizerError::BadMerge { index, merge: merge.clone() })?;
            if seen.insert((a, b)) {
                pairs.push((a.to_owned(), b.to_owned()));
            }
        }
        Ok(pairs)
    }

    fn token_type(&self, id: usize) -> i32 {
        // An absent array means every token is normal (type 1).
        self.token_types.get(id).copied().unwrap_or(1)
    }

    fn digest(&self, merges: &[(String, String)]) -> [u8; 32] {
        let mut w = DigestWriter::new("tandem-tokenizer-gguf/v1");
        w.bytes(self.model.as_bytes());
        w.bytes(self.pre.as_bytes());
        w.u64(self.tokens.len() as u64);
        for t in &self.tokens {
            w.bytes(t.as_bytes());
        }
        w.u64(merges.len() as u64);
        for (a, b) in merges {
            w.bytes(a.as_bytes());
            w.bytes(b.as_bytes());
        }
        for (id, _) in self.tokens.iter().enumerate() {
            let ty = self.token_type(id);
            if ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED {
                w.u64(id as u64);
                w.u64(ty as u64);
            }
        }
        w.finish()
    }
}

fn opt_id(f: &GgufFile, key: &str) -> Result<Option<u32>, TokenizerError> {
    let Some(v) = f.meta(key) else {
        return Ok(None);
    };
    let id = v.as_u64().ok_or_else(|| GgufError::Metadata {
        key: key.to_owned(),
        why: "expected a non-negative integer".to_owned(),
    })?;
    // Range against the vocabulary is checked once the tokenizer is built.
    let id = u32::try_from(id)
        .map_err(|_| GgufError::Metadata { key: key.to_owned(), why: format!("token id {id} does not fit u32") })?;
    Ok(Some(id))
}

fn opt_bool(f: &GgufFile, key: &str) -> Result<Option<bool>, TokenizerError> {
    let Some(v) = f.meta(key) else {
        return Ok(None);
    };
    Ok(Some(v.as_bool().ok_or_else(|| GgufError::Metadata { key: key.to_owned(), why: "expected a bool".to_owned() })?))
}

impl Tokenizer {
    /// Builds the tokenizer described by a GGUF file.
    pub fn from_gguf(f: &GgufFile) -> Result<Self, TokenizerError> {
        Self::from_parts(TokenizerParts::from_gguf(f)?)
    }

    /// Builds a byte-level BPE tokenizer from its parts.
    pub fn from_parts(parts: TokenizerParts) -> Result<Self, TokenizerError> {
        if parts.model != "gpt2" {
            return Err(TokenizerError::UnsupportedModel(parts.model));
        }
        let pre_tokenizer = parts.pre_tokenizer()?;
        if !parts.token_types.is_empty() && parts.token_types.len() != parts.tokens.len() {
            return Err(TokenizerError::TokenTypeCount { tokens: parts.tokens.len(), types: parts.token_types.len() });
        }
        if u32::try_from(parts.tokens.len()).is_err() {
            return Err(TokenizerError::VocabTooLarge(parts.tokens.len()));
        }

        let mut vocab = Vocab::with_capacity(parts.tokens.len());
        for (id, token) in parts.tokens.iter().enumerate() {
            // Fits: the length was checked above.
            let id = id as u32;
            if let Some(first) = vocab.insert(token.clone(), id) {
                return Err(TokenizerError::DuplicateToken { token: token.clone(), first, second: id });
            }
        }
        let merges = parts.merge_pairs()?;
        let digest = parts.digest(&merges);

        // No unk token: byte-level BPE can spell any input from its 256 byte tokens.
        let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().map_err(TokenizerError::Build)?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(pre_tokenizer));
        inner.with_decoder(Some(ByteLevelDecoder::default()));

        let mut control = Vec::new();
        let mut user_defined = Vec::new();
        for (id, token) in parts.tokens.iter().enumerate() {
            match parts.token_type(id) {
                TOKEN_TYPE_CONTROL => control.push(AddedToken::from(token.clone(), true)),
                TOKEN_TYPE_USER_DEFINED => user_defined.push(AddedToken::from(token.clone(), false).normalized(false)),
                _ => {}
            }
        }
        // Both map onto their existing vocabulary ids (same text).
        inner.add_special_tokens(&control);
        inner.add_tokens(&user_defined);

        Tokenizer::assemble(
            inner,
            Meta {
                bos_id: parts.bos_id,
                eos_id: parts.eos_id,
                eot_id: parts.eot_id,
                add_bos: parts.add_bos,
                chat_template: parts.chat_template,
                digest,
            },
        )
    }
}
