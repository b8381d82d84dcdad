//! When to stop generating, and which text is safe to stream.
//!
//! Token-level stops (stop ids, EOS, `max_tokens`) are decided per token.
//! Stop strings are matched on detokenized text, which arrives in pieces whose
//! boundaries need not line up with a stop string. The checker therefore holds
//! back the shortest tail of the unsent text that could still grow into a stop
//! string, and emits everything before it. Holding back *every* such tail, not
//! just the longest suffix that is a prefix of some stop string, is what makes
//! it sound: with stops `"ab"` and `"aab"`, the text `"xaa"` must keep `"aa"`
//! back, although `"a"` alone is also a viable prefix. The held text is at
//! most (longest stop string - 1) bytes plus the newest piece, so each check
//! is cheap.
//!
//! Matched stop strings are not emitted (OpenAI semantics), and neither is the
//! text of a stop token or EOS.

use serde::{Deserialize, Serialize};

use super::{SamplerError, SamplingParams};

/// Why a sequence ended, as reported in `finish_reason`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// A stop token, EOS, or stop string ended the sequence.
    Stop,
    /// `max_tokens` tokens were generated.
    Length,
}

/// What to stream after one step, and whether the sequence is over.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopDecision {
    /// Text that is now safe to send to the client (may be empty).
    pub emit: String,
    /// `Some` once the sequence is finished; no further text will be emitted.
    pub finished: Option<FinishReason>,
}

/// Per-sequence stop state: token count, stop ids, and held-back text.
#[derive(Debug, Clone)]
pub struct StopChecker {
    stop_token_ids: Vec<u32>,
    /// EOS ids, already emptied when the request set `ignore_eos`.
    eos_token_ids: Vec<u32>,
    stop_strings: Vec<String>,
    /// Length in bytes of the longest stop string.
    longest_stop: usize,
    max_tokens: u32,
    generated: u32,
    /// Text received but not yet emitted because it may start a stop string.
    pending: String,
    finished: Option<FinishReason>,
}

impl StopChecker {
    /// Builds the checker for one sequence. `eos_token_ids` are the model's
    /// end-of-sequence ids (several for chat models with an end-of-turn token);
    /// they are ignored when `params.ignore_eos` is set, while
    /// `params.stop_token_ids` always apply.
    pub fn new(params: &SamplingParams, eos_token_ids: &[u32]) -> Result<Self, SamplerError> {
        params.validate()?;
        Ok(Self {
            stop_token_ids: params.stop_token_ids.clone(),
            eos_token_ids: if params.ignore_eos { Vec::new() } else { eos_token_ids.to_vec() },
            stop_strings: params.stop_strings.clone(),
            longest_stop: params.stop_strings.iter().map(String::len).max().unwrap_or(0),
            max_tokens: params.max_tokens,
            generated: 0,
            pending: String::new(),
            finished: None,
        })
    }

    /// Handles one generated token and its text piece; the usual entry point.
    ///
    /// A stop token or EOS ends the sequence without emitting its piece. Any
    /// other piece goes through [`StopChecker::push_text`]; if that does not
    /// hit a stop string and the token reaches `max_tokens`, the held-back
    /// text is released and the sequence ends with [`FinishReason::Length`].
    /// Once finished, further calls emit nothing and repeat the reason.
    pub fn on_token(&mut self, token: u32, piece: &str) -> StopDecision {
        if let Some(reason) = self.finished {
            return finished(String::new(), reason);
        }
        match self.check_token(token) {
            Some(FinishReason::Stop) => {
                self.finished = Some(FinishReason::Stop);
                finished(std::mem::take(&mut self.pending), FinishReason::Stop)
            }
            Some(FinishReason::Length) => {
                let mut decision = self.push_text(piece);
                if decision.finished.is_none() {
                    decision.emit.push_str(&self.flush());
                    decision.finished = Some(FinishReason::Length);
                    self.finished = Some(FinishReason::Length);
                }
                decision
            }
            None => self.push_text(piece),
        }
    }

    /// Counts `token` and says whether it ends the sequence: `Stop` for a stop
    /// id or (unless `ignore_eos`) EOS, else `Length` when the count reaches
    /// `max_tokens`. It does not touch the text state; use
    /// [`StopChecker::on_token`] unless you order text and tokens yourself.
    pub fn check_token(&mut self, token: u32) -> Option<FinishReason> {
        self.generated = self.generated.saturating_add(1);
        if self.stop_token_ids.contains(&token) || self.eos_token_ids.contains(&token) {
            Some(FinishReason::Stop)
        } else if self.generated >= self.max_tokens {
            Some(FinishReason::Length)
        } else {
            None
        }
    }

    /// Appends a detokenized piece and returns the text that can no longer be
    /// part of a stop string. If a stop string now appears, emits the text
    /// before its earliest occurrence and finishes with `Stop`; the stop
    /// string and anything after it are dropped.
    pub fn push_text(&mut self, piece: &str) -> StopDecision {
        if let Some(reason) = self.finished {
            return finished(String::new(), reason);
        }
        if self.stop_strings.is_empty() {
            return StopDecision { emit: piece.to_owned(), finished: None };
        }
        self.pending.push_str(piece);
        // Every match lies inside `pending`: emitted text never ended with a
        // prefix of a stop string, so no match can start before it.
        let first_match = self.stop_strings.iter().filter_map(|s| self.pending.find(s.as_str())).min();
        if let Some(start) = first_match {
            let mut emit = std::mem::take(&mut self.pending);
            emit.truncate(start);
            self.finished = Some(FinishReason::Stop);
            return finished(emit, FinishReason::Stop);
        }
        let keep_from = self.holdback_start();
        let held = self.pending.split_off(keep_from);
        StopDecision { emit: std::mem::replace(&mut self.pending, held), finished: None }
    }

    /// Releases the held-back text at the end of generation (for example
    /// after a token-level stop signalled by [`StopChecker::check_token`], or
    /// an abort). Returns an empty string after a stop-string match.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// Why the sequence ended, once it has.
    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.finished
    }

    /// Tokens counted so far.
    pub fn generated(&self) -> u32 {
        self.generated
    }

    /// Byte offset of the earliest tail of `pending` that is a proper prefix
    /// of some stop string (`pending.len()` if none). Only the last
    /// `longest_stop - 1` bytes can qualify; full matches were handled before.
    fn holdback_start(&self) -> usize {
        let window = self.longest_stop.saturating_sub(1);
        let lo = self.pending.len().saturating_sub(window);
        self.pending
            .char_indices()
            .map(|(i, _)| i)
            .filter(|&i| i >= lo)
            .find(|&i| {
                let tail = &self.pending[i..];
                self.stop_strings.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(self.pending.len())
    }
}

fn finished(emit: String, reason: FinishReason) -> StopDecision {
    StopDecision { emit, finished: Some(reason) }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EOS: u32 = 2;

    fn checker(stops: &[&str]) -> StopChecker {
        let params =
            SamplingParams { stop_strings: stops.iter().map(|s| s.to_string()).collect(), ..SamplingParams::default() };
        StopChecker::new(&params, &[EOS]).expect("valid params")
    }

    /// Feeds `pieces`; returns every emission (plus the flush when no stop
    /// string matched) and the final reason.
    fn run(stops: &[&str], pieces: &[&str]) -> (Vec<String>, Option<FinishReason>) {
        let mut c = checker(stops);
        let mut out = Vec::new();
        for p in pieces {
            let d = c.push_text(p);
            out.push(d.emit);
            if d.finished.is_some() {
                return (out, d.finished);
            }
        }
        out.push(c.flush());
        (out, None)
    }

    #[test]
    fn stop_string_split_across_pieces_is_never_partly_emitted() {
        let (out, reason) = run(&["STOP"], &["hello S", "T", "O", "P world"]);
        assert_eq!(out, vec!["hello ", "", "", ""]);
        assert_eq!(reason, Some(FinishReason::Stop));
    }

    #[test]
    fn every_split_of_the_text_gives_the_same_result() {
        let text = "the quick brown fox says STOP! and more";
        let want = "the quick brown fox says ";
        let bytes: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
        // All two- and three-piece splits.
        for &a in &bytes {
            for &b in bytes.iter().filter(|&&b| b >= a) {
                let pieces = [&text[..a], &text[a..b], &text[b..]];
                let (out, reason) = run(&["STOP"], &pieces);
                assert_eq!(reason, Some(FinishReason::Stop), "split {a},{b}");
                assert_eq!(out.concat(), want, "split {a},{b}");
            }
        }
    }

    #[test]
    fn stop_string_at_very_start() {
        let (out, reason) = run(&["<end>"], &["<end>tail"]);
        assert_eq!(out.concat(), "");
        assert_eq!(reason, Some(FinishReason::Stop));

        let (out, reason) = run(&["<end>"], &["<", "en", "d>", "tail"]);
        assert_eq!(out, vec!["", "", ""]);
        assert_eq!(reason, Some(FinishReason::Stop));
    }

    #[test]
    fn overlapping_prefixes_hold_back_the_earliest_viable_tail() {
        let mut c = checker(&["ab", "aab"]);
        // "xaa": both "a" and "aa" could grow into a stop string.
        assert_eq!(c.push_text("xaa").emit, "x");
        let d = c.push_text("b");
        assert_eq!(d, finished(String::new(), FinishReason::Stop), "'aab' matched at 1");

        // With only "ab", "aab" stops after the first 'a'.
        let (out, reason) = run(&["ab"], &["a", "a", "b"]);
        assert_eq!(out.concat(), "a");
        assert_eq!(reason, Some(FinishReason::Stop));

        // A false start is released as soon as it can no longer match.
        let mut c = checker(&["aab"]);
        assert_eq!(c.push_text("aa").emit, "");
        assert_eq!(c.push_text("c").emit, "aac");
        assert_eq!(c.push_text("aaa").emit, "a", "'aa' may still become 'aab'");
        assert_eq!(c.flush(), "aa");
    }

    #[test]
    fn earliest_of_several_stop_strings_wins() {
        let (out, reason) = run(&["world", "lo w"], &["hello world"]);
        assert_eq!(out.concat(), "hel");
        assert_eq!(reason, Some(FinishReason::Stop));
    }

    #[test]
    fn unicode_stop_strings() {
        let (out, reason) = run(&["停止"], &["你好", "停", "止了"]);
        assert_eq!(out, vec!["你好", "", ""]);
        assert_eq!(reason, Some(FinishReason::Stop));

        // A multi-byte tail that is not a prefix is released whole.
        let mut c = checker(&["é!", "🙂🙃"]);
        assert_eq!(c.push_text("café").emit, "caf");
        assert_eq!(c.push_text("s 🙂").emit, "és ");
        assert_eq!(c.push_text("🙂").emit, "🙂");
        let d = c.push_text("🙃 after");
        assert_eq!(d, finished(String::new(), FinishReason::Stop));
    }

    #[test]
    fn flush_releases_held_text_and_no_stop_strings_passes_through() {
        let mut c = checker(&["###"]);
        assert_eq!(c.push_text("a#").emit, "a");
        assert_eq!(c.push_text("#").emit, "");
        assert_eq!(c.flush(), "##");
        assert_eq!(c.flush(), "");

        let mut c = checker(&[]);
        assert_eq!(c.push_text("any#").emit, "any#");
    }

    #[test]
    fn eos_and_stop_ids_stop_without_emitting_their_text() {
        let params =
            SamplingParams { stop_token_ids: vec![7], stop_strings: vec!["xyz".into()], ..SamplingParams::default() };
        let mut c = StopChecker::new(&params, &[EOS]).expect("valid params");
        assert_eq!(c.on_token(10, "ab x").emit, "ab ");
        let d = c.on_token(EOS, "</s>");
        assert_eq!(d, finished("x".into(), FinishReason::Stop), "held text released");
        assert_eq!(c.on_token(11, "more"), finished(String::new(), FinishReason::Stop));
        assert_eq!(c.finish_reason(), Some(FinishReason::Stop));

        let mut c = StopChecker::new(&params, &[EOS]).expect("valid params");
        assert_eq!(c.on_token(7, "seven"), finished(String::new(), FinishReason::Stop));
    }

    #[test]
    fn ignore_eos_keeps_going_but_honours_stop_ids() {
        let params = SamplingParams { stop_token_ids: vec![7], ignore_eos: true, ..SamplingParams::default() };
        let mut c = StopChecker::new(&params, &[EOS]).expect("valid params");
        assert_eq!(c.check_token(EOS), None);
        assert_eq!(c.check_token(7), Some(FinishReason::Stop));
    }

    #[test]
    fn max_tokens_finishes_with_length_and_emits_last_piece() {
        let params = SamplingParams { max_tokens: 2, stop_strings: vec!["END".into()], ..SamplingParams::default() };
        let mut c = StopChecker::new(&params, &[EOS]).expect("valid params");
        assert_eq!(c.on_token(10, "a"), StopDecision { emit: "a".into(), finished: None });
        let d = c.on_token(11, " E");
        assert_eq!(d, finished(" E".into(), FinishReason::Length));
        assert_eq!(c.generated(), 2);

        // A stop string completed by the last allowed token is still a Stop.
        let mut c = StopChecker::new(&params, &[EOS]).expect("valid params");
        assert_eq!(c.on_token(10, "xE").emit, "x");
        assert_eq!(c.on_token(11, "ND"), finished(String::new(), FinishReason::Stop));

        // EOS on the last allowed token is a Stop, not Length.
        let mut c = StopChecker::new(&params, &[EOS]).expect("valid params");
        c.on_token(10, "x");
        assert_eq!(c.on_token(EOS, ""), finished(String::new(), FinishReason::Stop));
    }

    #[test]
    fn invalid_params_are_rejected() {
        let params = SamplingParams { stop_strings: vec![String::new()], ..SamplingParams::default() };
        assert_eq!(StopChecker::new(&params, &[]).err(), Some(SamplerError::EmptyStopString { index: 0 }));
    }

    #[test]
    fn finish_reason_serializes_lowercase() -> Result<(), serde_json::Error> {
        assert_eq!(serde_json::to_string(&FinishReason::Stop)?, r#""stop""#);
        assert_eq!(serde_json::to_string(&FinishReason::Length)?, r#""length""#);
        let back: FinishReason = serde_json::from_str(r#""length""#)?;
        assert_eq!(back, FinishReason::Length);
        Ok(())
    }
}
