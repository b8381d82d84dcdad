//! An incremental Server-Sent Events parser: bytes in, whole events out,
//! no I/O (the WHATWG event-stream rules that OpenAI-style servers use).
//!
//! Lines end in LF, CR or CRLF, also when a CRLF is split across chunks;
//! `data:` lines of one event are joined with LF; an empty line dispatches;
//! `:` lines are comments; `id` sets the stream's last event id, which
//! every later event carries until another `id` (what a client resumes
//! from with `Last-Event-ID`); other fields are ignored. Bytes are kept until a line is whole, so a UTF-8 character split
//! across chunks decodes correctly. An event bigger than the limit is an
//! error rather than unbounded memory.

/// One dispatched event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// The `event:` field, if any.
    pub event: Option<String>,
    /// The `data:` lines, joined with `\n`.
    pub data: String,
    /// The stream's last event id when this event was dispatched: its own
    /// `id:`, else the last one before it.
    pub id: Option<String>,
}

/// The stream broke the parser's limits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    /// One event (its data plus the current line) passed the limit, in bytes.
    #[error("an SSE event passed {limit} bytes")]
    TooLarge { limit: usize },
}

/// Feed it chunks with [`SseParser::push`].
#[derive(Debug)]
pub struct SseParser {
    line: Vec<u8>,
    data: String,
    has_data: bool,
    event: Option<String>,
    /// The last event id buffer (WHATWG: it persists across events).
    last_id: Option<String>,
    /// The last chunk ended in CR: an LF first in the next one ends nothing.
    after_cr: bool,
    limit: usize,
}

impl SseParser {
    /// A parser that refuses events over `limit` bytes.
    pub fn new(limit: usize) -> Self {
        Self {
            line: Vec::new(),
            data: String::new(),
            has_data: false,
            event: None,
            last_id: None,
            after_cr: false,
            limit,
        }
    }

    /// Parses `bytes`, appending each event completed by them to `out`.
    pub fn push(&mut self, bytes: &[u8], out: &mut Vec<SseEvent>) -> Result<(), SseError> {
        let mut rest = bytes;
        while !rest.is_empty() {
            if self.after_cr {
                self.after_cr = false;
                if rest[0] == b'\n' {
                    rest = &rest[1..];
                    continue;
                }
            }
            match rest.iter().position(|&b| b == b'\n' || b == b'\r') {
                Some(i) => {
                    self.extend(&rest[..i])?;
                    self.after_cr = rest[i] == b'\r';
                    rest = &rest[i + 1..];
                    self.end_line(out);
                }
                None => {
                    self.extend(rest)?;
                    rest = &[];
                }
            }
        }
        Ok(())
    }

    /// Bytes of an unfinished line or event: what a stream that ends here drops.
    pub fn pending(&self) -> usize {
        self.line.len() + self.data.len()
    }

    fn extend(&mut self, b: &[u8]) -> Result<(), SseError> {
        if self.line.len() + self.data.len() + b.len() > self.limit {
            return Err(SseError::TooLarge { limit: self.limit });
        }
        self.line.extend_from_slice(b);
        Ok(())
    }

    fn end_line(&mut self, out: &mut Vec<SseEvent>) {
        let line = std::mem::take(&mut self.line);
        if line.is_empty() {
            if self.has_data {
                let data = std::mem::take(&mut self.data);
                out.push(SseEvent { event: self.event.take(), data, id: self.last_id.clone() });
            }
            self.has_data = false;
            self.event = None;
            self.data.clear();
            return;
        }
        let line = String::from_utf8_lossy(&line);
        if line.starts_with(':') {
            return;
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (&*line, ""),
        };
        match field {
            "data" => {
                if self.has_data {
                    self.data.push('\n');
                }
                self.data.push_str(value);
                self.has_data = true;
            }
            "event" => self.event = Some(value.to_owned()),
            // An id with a NUL is ignored (WHATWG).
            "id" if !value.contains('\0') => self.last_id = Some(value.to_owned()),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use types::rng::XorShift64;

    fn parse_chunks(chunks: &[&[u8]]) -> Result<Vec<SseEvent>, SseError> {
        let mut p = SseParser::new(1 << 20);
        let mut out = Vec::new();
        for c in chunks {
            p.push(c, &mut out)?;
        }
        Ok(out)
    }

    fn data(events: &[SseEvent]) -> Vec<&str> {
        events.iter().map(|e| e.data.as_str()).collect()
    }

    const STREAM: &str = "data: {\"a\":1}\n\n: keep-alive\n\ndata: {\"b\":\"\u{e9}t\u{e9}\"}\r\n\r\ndata: [DONE]\n\n";

    #[test]
    fn events_split_across_chunks_at_every_byte() -> Result<(), SseError> {
        let whole = parse_chunks(&[STREAM.as_bytes()])?;
        assert_eq!(data(&whole), ["{\"a\":1}", "{\"b\":\"\u{e9}t\u{e9}\"}", "[DONE]"]);
        let b = STREAM.as_bytes();
        for i in 0..b.len() {
            for j in i..b.len() {
                assert_eq!(parse_chunks(&[&b[..i], &b[i..j], &b[j..]])?, whole, "split at {i}, {j}");
            }
        }
        Ok(())
    }

    /// A character of two, three or four bytes split anywhere across two or three chunks
    /// decodes whole: no replacement character, no lost byte.
    #[test]
    fn every_split_of_a_multi_byte_character_decodes_whole() -> Result<(), SseError> {
        for ch in ["\u{e9}", "\u{20ac}", "\u{1f600}"] {
            let stream = format!("data: a{ch}b\n\ndata: {ch}\n\n");
            let b = stream.as_bytes();
            for i in 0..=b.len() {
                for j in i..=b.len() {
                    let got = parse_chunks(&[&b[..i], &b[i..j], &b[j..]])?;
                    assert_eq!(data(&got), [format!("a{ch}b"), ch.to_owned()], "{ch:?} split at {i}, {j}");
                }
            }
        }
        Ok(())
    }

    #[test]
    fn several_events_in_one_chunk_and_none_until_the_blank_line() -> Result<(), SseError> {
        let mut p = SseParser::new(1024);
        let mut out = Vec::new();
        p.push(b"data: 1\n\ndata: 2\n\ndata: 3\n", &mut out)?;
        assert_eq!(data(&out), ["1", "2"]);
        assert!(p.pending() > 0);
        p.push(b"\n", &mut out)?;
        assert_eq!(data(&out), ["1", "2", "3"]);
        Ok(())
    }

    #[test]
    fn multi_line_data_event_names_and_bare_cr() -> Result<(), SseError> {
        let out = parse_chunks(&[b"event: error\rdata: x\rdata:y\r\rid: 7\nretry: 5\ndata\n\n"])?;
        assert_eq!(
            out,
            [
                SseEvent { event: Some("error".into()), data: "x\ny".into(), id: None },
                SseEvent { event: None, data: String::new(), id: Some("7".into()) }
            ]
        );
        Ok(())
    }

    #[test]
    fn the_last_event_id_carries_over_to_events_without_one() -> Result<(), SseError> {
        let out = parse_chunks(&[b"id: 1-a\ndata: x\n\ndata: y\n\nid: 2-b\ndata: z\n\nid: b\0d\ndata: w\n\n"])?;
        let ids: Vec<Option<&str>> = out.iter().map(|e| e.id.as_deref()).collect();
        assert_eq!(ids, [Some("1-a"), Some("1-a"), Some("2-b"), Some("2-b")]);
        Ok(())
    }

    #[test]
    fn an_error_event_is_an_ordinary_event() -> Result<(), SseError> {
        let out = parse_chunks(&[b"data: {\"error\":{\"code\":\"deadline_exceeded\"}}\n", b"\n"])?;
        assert_eq!(data(&out), ["{\"error\":{\"code\":\"deadline_exceeded\"}}"]);
        Ok(())
    }

    #[test]
    fn oversized_events_are_refused() {
        let mut p = SseParser::new(16);
        let mut out = Vec::new();
        assert_eq!(p.push(b"data: 0123456789", &mut out), Ok(()));
        assert_eq!(p.push(b"abcdef\n", &mut out), Err(SseError::TooLarge { limit: 16 }));
        let mut p = SseParser::new(16);
        assert_eq!(p.push(b"data: 0123456789\n", &mut out), Ok(()));
        assert_eq!(p.push(b"data: 0123456789\n", &mut out), Err(SseError::TooLarge { limit: 16 }));
    }

    #[test]
    fn random_bytes_never_panic_and_stay_bounded() {
        let mut rng = XorShift64::seeded(5);
        let alphabet = b"data: \n\r:{}[DONE]\xff\xc3";
        for _ in 0..2000 {
            let mut p = SseParser::new(64);
            let mut out = Vec::new();
            for _ in 0..rng.index(8) {
                let chunk: Vec<u8> = (0..rng.index(40)).map(|_| alphabet[rng.index(alphabet.len())]).collect();
                if p.push(&chunk, &mut out).is_err() {
                    break;
                }
                assert!(p.pending() <= 64);
            }
        }
    }
}
