//! The tokenizer's error type.

use std::path::PathBuf;

use crate::gguf::GgufError;

/// The error type of `tokenizers`: a boxed error with no further structure.
type LibError = tokenizers::Error;

/// Everything that can go wrong building or using a [`super::Tokenizer`].
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A tokenizer key in the GGUF file is missing or has the wrong type.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// `tokenizer.ggml.model` names a tokenizer this engine does not build
    /// (only byte-level BPE, "gpt2", is supported; SentencePiece "llama" is not).
    #[error("unsupported tokenizer model {0:?} (supported: \"gpt2\")")]
    UnsupportedModel(String),
    /// `tokenizer.ggml.pre` names a pre-tokenizer this engine does not know.
    #[error("unsupported pre-tokenizer {0:?} (supported: \"smollm\", \"gpt2\", \"default\")")]
    UnsupportedPreTokenizer(String),
    /// The token-type array does not have one entry per token.
    #[error("{types} token types for {tokens} tokens")]
    TokenTypeCount { tokens: usize, types: usize },
    /// Two ids share the same token text, so text -> id is ambiguous.
    #[error("token {token:?} appears at ids {first} and {second}")]
    DuplicateToken { token: String, first: u32, second: u32 },
    /// The vocabulary has more entries than a u32 id can address.
    #[error("vocabulary of {0} tokens does not fit u32 ids")]
    VocabTooLarge(usize),
    /// A merge rule is not two tokens separated by a space.
    #[error("merge {index} ({merge:?}) is not \"left right\"")]
    BadMerge { index: usize, merge: String },
    /// A special-token id (bos, eos, ...) lies outside the vocabulary.
    #[error("{what} id {id} is outside the vocabulary of {vocab_size}")]
    SpecialIdOutOfRange { what: &'static str, id: u64, vocab_size: usize },
    /// The file asks for a BOS token to be added but names none.
    #[error("add_bos is set but there is no BOS token")]
    MissingBos,
    /// `tokenizers` refused the vocabulary or merges (e.g. a merge names a
    /// token that is not in the vocabulary).
    #[error("cannot build the tokenizer: {0}")]
    Build(#[source] LibError),
    /// A tokenizer file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// tokenizer.json or tokenizer_config.json is not what it should be.
    #[error("{path}: {why}")]
    BadFile { path: PathBuf, why: String },
    /// A special token named in tokenizer_config.json is not in the vocabulary.
    #[error("{what} {token:?} from tokenizer_config.json is not in the vocabulary")]
    UnknownSpecialToken { what: &'static str, token: String },
    /// Encoding failed inside `tokenizers`.
    #[error("encode failed: {0}")]
    Encode(#[source] LibError),
    /// Decoding failed inside `tokenizers`.
    #[error("decode failed: {0}")]
    Decode(#[source] LibError),
    /// A token id the vocabulary does not have (caller input).
    #[error("token id {id} is outside the vocabulary of {vocab_size}")]
    InvalidTokenId { id: u32, vocab_size: usize },
    /// The model file carries no chat template.
    #[error("the model has no chat template")]
    NoChatTemplate,
    /// The model's chat template does not compile; plain completion still works.
    #[error("the model's chat template does not compile: {0}")]
    TemplateSyntax(String),
    /// Rendering the chat template failed for a reason other than
    /// `raise_exception` (a template feature this engine lacks, a bad value).
    #[error("chat template failed: {0}")]
    TemplateRender(String),
    /// The template itself rejected the conversation via `raise_exception`
    /// (e.g. roles that do not alternate).
    #[error("chat template rejected the messages: {0}")]
    TemplateException(String),
}

impl TokenizerError {
    /// True when the request, not the model or the engine, is at fault: the
    /// caller should answer "invalid input" rather than retry or alarm.
    pub fn is_invalid_input(&self) -> bool {
        matches!(self, Self::InvalidTokenId { .. } | Self::TemplateException(_))
    }
}
