//! Streaming detokenization.
//!
//! A byte-level BPE token is a run of bytes, not of characters: an emoji's
//! four UTF-8 bytes may arrive over two or three tokens, and decoding one
//! token alone yields U+FFFD. Decoding the whole sequence again after every
//! token would be right but quadratic. The decoder keeps a short window
//! instead (the prefix-offset / read-offset scheme of TGI and vLLM):
//!
//! * `ids[..read]`, the last emitted chunk, is decoded again only as
//!   context, because some decoders (SentencePiece's leading-space rule)
//!   render a token differently at the start of a text;
//! * `ids[read..]` is pending. Each push decodes the whole window; if that
//!   text does not end in U+FFFD (an incomplete character), the part past
//!   the context is emitted and the pending tokens become the new context.
//!
//! The window holds one emitted chunk plus the pending tokens, so each push
//! costs O(1) amortised. A character is at most 4 bytes, so more than
//! [`MAX_PENDING`] pending tokens cannot be a split character: the text is
//! then invalid bytes the model really produced, and is emitted with its
//! replacement characters rather than held back forever.
//!
//! Special tokens (`<|im_end|>`, ...) are not part of the text: a push of one
//! returns "" and leaves the window alone; the caller sees the id itself.

use super::{Tokenizer, TokenizerError};

/// Pending tokens after which the held-back text is emitted regardless.
const MAX_PENDING: usize = 8;

/// Turns a stream of token ids into a stream of text that never ends in the
/// middle of a UTF-8 character. One per generated sequence.
#[derive(Debug, Clone, Default)]
pub struct IncrementalDecoder {
    /// The window: `ids[..read]` is the last emitted chunk, kept as context;
    /// `ids[read..]` is pending.
    ids: Vec<u32>,
    read: usize,
}

impl IncrementalDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one generated id; returns the text it completes (often "", e.g.
    /// while a character is split across tokens, or for a special token).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String, TokenizerError> {
        if tok.is_special(id) {
            // Unknown ids are not special: they reach check_ids below.
            return Ok(String::new());
        }
        tok.check_ids(&[id])?;
        self.ids.push(id);
        let context = tok.decode(&self.ids[..self.read], true)?;
        let text = tok.decode(&self.ids, true)?;
        let pending = self.ids.len() - self.read;
        if text.ends_with(char::REPLACEMENT_CHARACTER) && pending <= MAX_PENDING {
            return Ok(String::new());
        }
        let new = suffix_after(&text, &context);
        if text.ends_with(char::REPLACEMENT_CHARACTER) {
            // Forced out: the next tokens must not be decoded together with
            // these bytes, or they could complete a character whose
            // replacement was already emitted.
            self.ids.clear();
            self.read = 0;
        } else {
            // Drop what can no longer be context, keeping the vector short.
            self.ids.drain(..self.read);
            self.read = self.ids.len();
        }
        Ok(new)
    }

    /// Returns the text still held back (an incomplete character at the end
    /// of the sequence comes out as U+FFFD) and resets the decoder.
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<String, TokenizerError> {
        let out = if self.read < self.ids.len() {
            let context = tok.decode(&self.ids[..self.read], true)?;
            let text = tok.decode(&self.ids, true)?;
            suffix_after(&text, &context)
        } else {
            String::new()
        };
        *self = Self::default();
        Ok(out)
    }
}

/// `text` minus the already-emitted `context` at its start.
fn suffix_after(text: &str, context: &str) -> String {
    if let Some(rest) = text.strip_prefix(context) {
        return rest.to_owned();
    }
    // The context rendered differently with more tokens after it (a decoder
    // whose output for a token depends on the next). Emitted text cannot be
    // taken back, so emit what lies past the same number of bytes, from the
    // next character boundary.
    let mut at = context.len().min(text.len());
    while !text.is_char_boundary(at) {
        at += 1;
    }
    text[at..].to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::tests::tiny;

    fn stream(tok: &Tokenizer, ids: &[u32]) -> Result<Vec<String>, TokenizerError> {
        let mut d = IncrementalDecoder::new();
        let mut out = ids.iter().map(|&id| d.push(tok, id)).collect::<Result<Vec<_>, _>>()?;
        out.push(d.finish(tok)?);
        Ok(out)
    }

    #[test]
    fn split_emoji_is_held_until_complete() -> Result<(), TokenizerError> {
        let tok = tiny()?;
        // Byte tokens only: "a😀b" is 1 + 4 + 1 tokens.
        let ids = tok.encode("a😀b", false)?;
        assert_eq!(ids.len(), 6);
        let pieces = stream(&tok, &ids)?;
        assert_eq!(pieces, ["a", "", "", "", "😀", "b", ""]);
        Ok(())
    }

    #[test]
    fn special_tokens_are_skipped_without_disturbing_the_window() -> Result<(), TokenizerError> {
        let tok = tiny()?;
        let mut ids = tok.encode("é", false)?;
        // A special token between the two bytes of "é".
        ids.insert(1, 2);
        assert!(tok.is_special(2));
        let pieces = stream(&tok, &ids)?;
        assert_eq!(pieces.concat(), "é");
        assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')));
        Ok(())
    }

    #[test]
    fn invalid_bytes_are_emitted_after_the_bound() -> Result<(), TokenizerError> {
        let tok = tiny()?;
        // A lone lead byte (0xF0) followed by more lead bytes never completes.
        let lead = tok.encode("😀", false)?[0];
        let ids = vec![lead; MAX_PENDING + 3];
        let mut d = IncrementalDecoder::new();
        let mut emitted = String::new();
        for &id in &ids {
            emitted.push_str(&d.push(&tok, id)?);
            assert!(d.ids.len() <= MAX_PENDING + 2, "window grew to {}", d.ids.len());
        }
        emitted.push_str(&d.finish(&tok)?);
        assert_eq!(emitted.chars().count(), ids.len());
        assert!(emitted.chars().all(|c| c == '\u{FFFD}'));
        Ok(())
    }

    #[test]
    fn window_stays_bounded_on_long_streams() -> Result<(), TokenizerError> {
        let tok = tiny()?;
        let text = "hello world, ünïcödé 😀 ".repeat(50);
        let ids = tok.encode(&text, false)?;
        let mut d = IncrementalDecoder::new();
        let mut out = String::new();
        for &id in &ids {
            out.push_str(&d.push(&tok, id)?);
            assert!(d.ids.len() <= 2 * 4, "window grew to {}", d.ids.len());
        }
        out.push_str(&d.finish(&tok)?);
        assert_eq!(out, text);
        Ok(())
    }

    #[test]
    fn unknown_id_is_an_error() -> Result<(), TokenizerError> {
        let tok = tiny()?;
        let mut d = IncrementalDecoder::new();
        let err = d.push(&tok, tok.vocab_size() as u32);
        assert!(matches!(err, Err(TokenizerError::InvalidTokenId { .. })));
        Ok(())
    }

    #[test]
    fn suffix_after_handles_a_changed_context() {
        assert_eq!(suffix_after("abc", "ab"), "c");
        assert_eq!(suffix_after("xyz", "xq"), "z");
        // Never slices inside a character.
        assert_eq!(suffix_after("xé", "xy"), "");
        assert_eq!(suffix_after("ab", "abc"), "");
    }
}
