//! The resume cursor: where in its answer a stream event stands, so that a
//! client that lost its coordinator can ask any other for the rest.
//!
//! Every event of a streamed answer carries one (SSE `id:`, gRPC
//! `Chunk.cursor`): the number of tokens generated when it was sent (stop-
//! string tokens and tokens whose text is still held back included), a hash
//! of those token ids, and, for the second and later events sent at the same
//! token count (a flushed tail, the finish chunk, usage, `[DONE]`), its
//! ordinal there: `17-00c0ffee00c0ffee`, `17-00c0ffee00c0ffee.2`.
//!
//! Why this resumes exactly: an answer is a pure function of the prompt, the
//! sampling parameters and the seed (sampling by position, the same bits on
//! every ISA and batch size), and the events are a pure function of the
//! tokens. So a coordinator given the same request, the same seed (the
//! body's, or the one its `Idempotency-Key` derives) and a cursor regenerates
//! the same events, checks the hash when it reaches the cursor's token count
//! ([`Resume`]) and sends only the events after it. A hash that differs (a
//! worker of another build, tokenizer or sampler; a client that changed the
//! request) is a typed error before anything is sent, never wrong text.
//!
//! The hash is FNV-1a (64 bits) over each id's four little-endian bytes: the
//! format is part of the API (a cursor from one coordinator is read by
//! another, of another release), so it is fixed here and tested by value.

use std::fmt;
use std::str::FromStr;

use tokio::sync::oneshot;

use crate::error::Error;
use crate::idempotency::{Replay, Replayed};

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// The running hash of the token ids generated so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chain {
    tokens: u32,
    hash: u64,
}

impl Default for Chain {
    fn default() -> Self {
        Self { tokens: 0, hash: FNV_OFFSET }
    }
}

impl Chain {
    /// One more token.
    pub fn push(&mut self, id: u32) {
        for b in id.to_le_bytes() {
            self.hash = (self.hash ^ u64::from(b)).wrapping_mul(FNV_PRIME);
        }
        self.tokens += 1;
    }

    /// Tokens pushed.
    pub fn tokens(&self) -> u32 {
        self.tokens
    }

    /// The hash of every token pushed.
    pub fn hash(&self) -> u64 {
        self.hash
    }

    /// The chain of `ids`.
    pub fn of(ids: &[u32]) -> Self {
        let mut c = Self::default();
        ids.iter().for_each(|&id| c.push(id));
        c
    }
}

/// One event's place in its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cursor {
    /// Tokens generated when the event was sent.
    pub tokens: u32,
    /// The hash of those tokens' ids ([`Chain::hash`]).
    pub hash: u64,
    /// Events sent before this one at the same token count.
    pub ordinal: u32,
}

impl fmt::Display for Cursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{:016x}", self.tokens, self.hash)?;
        if self.ordinal > 0 {
            write!(f, ".{}", self.ordinal)?;
        }
        Ok(())
    }
}

/// Longest cursor accepted, bytes (`4294967295-ffffffffffffffff.4294967295` is 38).
const MAX_CURSOR_LEN: usize = 40;

impl FromStr for Cursor {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("{s:?} is not a tandem stream cursor (TOKENS-HASH16 or TOKENS-HASH16.ORDINAL)");
        if s.len() > MAX_CURSOR_LEN || !s.is_ascii() {
            return Err(bad());
        }
        let (tokens, rest) = s.split_once('-').ok_or_else(bad)?;
        let (hash, ordinal) = match rest.split_once('.') {
            Some((h, o)) => (h, Some(o)),
            None => (rest, None),
        };
        let digits = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
        let hex = hash.len() == 16 && hash.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        if !digits(tokens) || !hex || ordinal.is_some_and(|o| !digits(o) || o.starts_with('0')) {
            return Err(bad());
        }
        Ok(Cursor {
            tokens: tokens.parse().map_err(|_| bad())?,
            hash: u64::from_str_radix(hash, 16).map_err(|_| bad())?,
            ordinal: ordinal.map_or(Ok(0), str::parse).map_err(|_| bad())?,
        })
    }
}

/// Gives each event of one answer its cursor, in the order they are sent.
#[derive(Debug, Default)]
pub struct Stamper {
    last: Option<Cursor>,
}

impl Stamper {
    /// The cursor of the next event, sent with `chain` generated.
    pub fn stamp(&mut self, chain: Chain) -> Cursor {
        let ordinal = match self.last {
            Some(l) if l.tokens == chain.tokens() => l.ordinal + 1,
            _ => 0,
        };
        let c = Cursor { tokens: chain.tokens(), hash: chain.hash(), ordinal };
        self.last = Some(c);
        c
    }

    /// The cursor of the last event stamped: what a client that saw it resumes
    /// from; `None` before the first.
    pub fn last(&self) -> Option<Cursor> {
        self.last
    }
}

/// What a regenerated event is, for a stream resumed from a cursor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    /// The client has it (it is at or before the cursor): not sent.
    Had,
    /// The cursor's own event, checked: not sent, and everything after is.
    Reached,
    /// After the cursor: sent.
    New,
}

/// Follows a regenerated answer up to the cursor a client resumed from.
#[derive(Debug, Clone)]
pub struct Resume {
    at: Cursor,
    reached: bool,
}

impl Resume {
    pub fn new(at: Cursor) -> Self {
        Self { at, reached: false }
    }

    /// The cursor resumed from.
    pub fn at(&self) -> Cursor {
        self.at
    }

    /// Whether the cursor's event has been regenerated and checked.
    pub fn reached(&self) -> bool {
        self.reached
    }

    /// Places the next regenerated event, stamped `c`. An event at the
    /// cursor's token count with another hash, or one past the cursor that
    /// never passed it, means the answer is not the one the client had:
    /// [`Error::ResumeMismatch`].
    pub fn see(&mut self, c: Cursor) -> Result<Seen, Error> {
        if self.reached {
            return Ok(Seen::New);
        }
        let at = self.at;
        let mismatch = || Error::ResumeMismatch { tokens: at.tokens };
        if c.tokens < at.tokens {
            return Ok(Seen::Had);
        }
        if c.tokens > at.tokens || c.hash != at.hash || c.ordinal > at.ordinal {
            return Err(mismatch());
        }
        if c.ordinal < at.ordinal {
            return Ok(Seen::Had);
        }
        self.reached = true;
        Ok(Seen::Reached)
    }

    /// The regenerated answer ended: fine only once the cursor was reached.
    pub fn ended(&self) -> Result<(), Error> {
        if self.reached {
            Ok(())
        } else {
            Err(Error::ResumeMismatch { tokens: self.at.tokens })
        }
    }
}

/// A resumed stream's gate, as both frontends run it. The regenerated events up to
/// its cursor are checked against it ([`Resume`]) and held back, since the client has
/// them; whoever answers the client waits on the gate and is told once: the cursor's
/// own event matched, or why the stream cannot resume (`E`: HTTP tells an [`Error`]
/// and answers it in place of the head, gRPC a status).
pub struct Gate<E> {
    resume: Resume,
    verified: Option<oneshot::Sender<Result<(), E>>>,
}

/// What a [`Gate`] makes of one regenerated event.
#[derive(Debug, PartialEq)]
pub enum Pass {
    /// Past the cursor: send it.
    Send,
    /// Up to and including the cursor: held back. Regenerating goes on while `go_on`
    /// (the client's side still waits, or has been told and is there); `reached` when
    /// this was the cursor's own event and the client's side was told it matched.
    Held { go_on: bool, reached: bool },
    /// Not the answer the client had: the stream ends, and the caller refuses the
    /// client's side ([`Gate::refuse`]).
    Mismatch(Error),
}

impl<E> Gate<E> {
    /// A gate at cursor `at`, and what the client's side waits on.
    pub fn new(at: Cursor) -> (Self, oneshot::Receiver<Result<(), E>>) {
        let (tx, rx) = oneshot::channel();
        (Self { resume: Resume::new(at), verified: Some(tx) }, rx)
    }

    /// Places the next regenerated event, stamped `c`.
    pub fn pass(&mut self, c: Cursor) -> Pass {
        match self.resume.see(c) {
            Ok(Seen::New) => Pass::Send,
            Ok(Seen::Had) => {
                Pass::Held { go_on: self.verified.as_ref().is_some_and(|v| !v.is_closed()), reached: false }
            }
            Ok(Seen::Reached) => {
                Pass::Held { go_on: self.verified.take().is_some_and(|v| v.send(Ok(())).is_ok()), reached: true }
            }
            Err(e) => Pass::Mismatch(e),
        }
    }

    /// Whether the client's side still waits: nothing has been sent to the client.
    pub fn waiting(&self) -> bool {
        self.verified.is_some()
    }

    /// Tells the client's side, if it still waits, that the stream cannot resume.
    pub fn refuse(&mut self, e: E) {
        if let Some(v) = self.verified.take() {
            let _ = v.send(Err(e));
        }
    }

    /// The regenerated stream ended: while the client's side still waits, it ended
    /// before its cursor and was another answer.
    pub fn ended(&self) -> Result<(), Error> {
        if self.waiting() {
            self.resume.ended()
        } else {
            Ok(())
        }
    }
}

/// Reads a retry's replay (the first attempt's recorded events, then its live ones)
/// up to and including the event at cursor `at`, checking each against it; `first` is
/// an item already read. `cursor_of` gives a recorded event's cursor, `None` for an item
/// that says the first attempt failed or was refused: nothing to resume from.
pub async fn skip_to<T: Clone>(
    replay: &mut Replay<T>,
    mut first: Option<Replayed<T>>,
    at: Cursor,
    cursor_of: fn(&T) -> Option<&str>,
) -> Result<(), Error> {
    let mut resume = Resume::new(at);
    loop {
        let next = match first.take() {
            Some(f) => f,
            None => replay.next().await,
        };
        match next {
            Replayed::Item(item) => {
                let Some(id) = cursor_of(&item) else { return Err(Error::IdempotentOriginalFailed) };
                let c = id.parse::<Cursor>().map_err(|_| Error::ResumeMismatch { tokens: at.tokens })?;
                if resume.see(c)? != Seen::Had {
                    return Ok(());
                }
            }
            Replayed::Abandoned => return Err(Error::IdempotentOriginalFailed),
            Replayed::End => return resume.ended(),
        }
    }
}

/// The `outcome` label of a resume
/// ([`facts::metrics::coordinator::STREAM_RESUMES`]): `ok`, `mismatch` or `failed`.
pub fn resume_outcome(checked: &Result<(), Error>) -> &'static str {
    match checked {
        Ok(()) => "ok",
        Err(Error::ResumeMismatch { .. }) => "mismatch",
        Err(_) => "failed",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hash_is_fnv1a_over_little_endian_ids() {
        // Fixed values: a cursor must mean the same to every coordinator and release.
        assert_eq!(Chain::default().hash(), 0xcbf2_9ce4_8422_2325);
        let c = Chain::of(&[1]);
        let mut h = FNV_OFFSET;
        for b in [1u8, 0, 0, 0] {
            h = (h ^ u64::from(b)).wrapping_mul(FNV_PRIME);
        }
        assert_eq!(c.hash(), h);
        assert_eq!(Chain::of(&[1, 2, 3]).hash(), 0xfd1f_0f43_81eb_0395, "a fixed vector");
        assert_ne!(Chain::of(&[1, 2]).hash(), Chain::of(&[2, 1]).hash(), "order counts");
        assert_ne!(Chain::of(&[256]).hash(), Chain::of(&[1]).hash(), "every byte counts");
        assert_eq!(Chain::of(&[5, 6, 7]).tokens(), 3);
    }

    #[test]
    fn cursors_print_and_parse_back() {
        for c in [
            Cursor { tokens: 0, hash: 0, ordinal: 0 },
            Cursor { tokens: 17, hash: 0x00c0_ffee_00c0_ffee, ordinal: 0 },
            Cursor { tokens: u32::MAX, hash: u64::MAX, ordinal: u32::MAX },
        ] {
            let s = c.to_string();
            assert!(s.len() <= MAX_CURSOR_LEN, "{s}");
            assert_eq!(s.parse::<Cursor>(), Ok(c), "{s}");
        }
        assert_eq!(Cursor { tokens: 17, hash: 0xab, ordinal: 2 }.to_string(), "17-00000000000000ab.2");
        for bad in [
            "",
            "17",
            "17-",
            "-00000000000000ab",
            "17-ab",
            "17-00000000000000AB",
            "17-00000000000000ab.",
            "17-00000000000000ab.02",
            "17-00000000000000ab.0",
            "+17-00000000000000ab",
            "4294967296-00000000000000ab",
            "17-00000000000000ab.x",
            "17-00000000000000ab-1",
            "１7-00000000000000ab",
        ] {
            assert!(bad.parse::<Cursor>().is_err(), "{bad:?} parsed");
        }
    }

    /// The cursors of an answer whose events came at these token counts.
    fn stamped(counts: &[u32], ids: &[u32]) -> Vec<Cursor> {
        let mut s = Stamper::default();
        counts.iter().map(|&n| s.stamp(Chain::of(&ids[..n as usize]))).collect()
    }

    #[test]
    fn events_at_one_token_count_get_ordinals() {
        let ids = [7, 8, 9];
        let c = stamped(&[0, 1, 3, 3, 3], &ids);
        assert_eq!(
            c.iter().map(|c| (c.tokens, c.ordinal)).collect::<Vec<_>>(),
            [(0, 0), (1, 0), (3, 0), (3, 1), (3, 2)]
        );
        assert!(c.windows(2).all(|w| w[0] != w[1]), "every event's cursor is its own");
    }

    #[test]
    fn a_resume_skips_what_the_client_had_and_sends_the_rest() {
        let ids = [7, 8, 9, 10];
        let events = stamped(&[0, 1, 3, 4, 4, 4], &ids);
        for (k, &at) in events.iter().enumerate() {
            let mut r = Resume::new(at);
            let seen: Vec<Seen> = events.iter().map(|&c| r.see(c).expect("the same answer")).collect();
            let mut want = vec![Seen::Had; k];
            want.push(Seen::Reached);
            want.extend(vec![Seen::New; events.len() - k - 1]);
            assert_eq!(seen, want, "resumed at event {k}");
            assert_eq!(r.ended(), Ok(()));
        }
    }

    #[test]
    fn a_gate_holds_back_what_the_client_had_and_tells_its_waiter_once() {
        let events = stamped(&[0, 1, 3, 4], &[7, 8, 9, 10]);
        let (mut g, mut waiter) = Gate::<Error>::new(events[1]);
        assert_eq!(g.pass(events[0]), Pass::Held { go_on: true, reached: false });
        assert!(g.waiting() && waiter.try_recv().is_err(), "nothing told before the cursor");
        assert_eq!(g.pass(events[1]), Pass::Held { go_on: true, reached: true });
        assert_eq!(waiter.try_recv(), Ok(Ok(())), "told at the cursor");
        assert!(!g.waiting());
        assert_eq!((g.pass(events[2]), g.pass(events[3])), (Pass::Send, Pass::Send));
        assert_eq!(g.ended(), Ok(()));

        // Another answer: a mismatch at the cursor, and the waiter told why.
        let other = stamped(&[0, 1, 3], &[7, 5, 9]);
        let (mut g, mut waiter) = Gate::<Error>::new(events[2]);
        assert_eq!(g.pass(other[1]), Pass::Held { go_on: true, reached: false });
        let Pass::Mismatch(e) = g.pass(other[2]) else { panic!("another answer passed") };
        g.refuse(e);
        assert_eq!(waiter.try_recv(), Ok(Err(Error::ResumeMismatch { tokens: 3 })));

        // An answer that ends before its cursor is another one; a waiter that left stops it.
        let (mut g, waiter) = Gate::<Error>::new(events[3]);
        assert_eq!(g.pass(events[0]), Pass::Held { go_on: true, reached: false });
        assert_eq!(g.ended(), Err(Error::ResumeMismatch { tokens: 4 }));
        drop(waiter);
        assert_eq!(g.pass(events[1]), Pass::Held { go_on: false, reached: false }, "nobody waits: stop");
    }

    #[test]
    fn another_answer_is_refused_at_the_cursor() {
        let had = stamped(&[0, 2, 3], &[7, 8, 9]);
        // Another token at index 1: the hash at 3 differs.
        let other = stamped(&[0, 2, 3], &[7, 5, 9]);
        let mut r = Resume::new(had[2]);
        assert_eq!(r.see(other[0]), Ok(Seen::Had));
        assert_eq!(r.see(other[1]), Ok(Seen::Had), "hashes before the cursor's count are not comparable");
        assert_eq!(r.see(other[2]), Err(Error::ResumeMismatch { tokens: 3 }));
        // The same tokens but the cursor's event never comes (its text came at another count).
        let shifted = stamped(&[0, 2, 4], &[7, 8, 9, 10]);
        let mut r = Resume::new(had[2]);
        assert_eq!(r.see(shifted[1]), Ok(Seen::Had));
        assert_eq!(r.see(shifted[2]), Err(Error::ResumeMismatch { tokens: 3 }));
        // A cursor past the end of the regenerated answer.
        let mut r = Resume::new(Cursor { tokens: 9, hash: 1, ordinal: 0 });
        had.iter().for_each(|&c| assert_eq!(r.see(c), Ok(Seen::Had)));
        assert_eq!(r.ended(), Err(Error::ResumeMismatch { tokens: 9 }));
        // An ordinal the answer never had at that count.
        let mut r = Resume::new(Cursor { ordinal: 5, ..had[2] });
        assert_eq!(r.see(had[2]), Ok(Seen::Had));
        assert_eq!(r.ended(), Err(Error::ResumeMismatch { tokens: 3 }));
    }
}
