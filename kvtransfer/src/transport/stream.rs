//! Frames over any ordered byte stream: a TCP connection, a QUIC stream.
//!
//! Reading: [`FrameReader`] keeps a small read-ahead buffer for headers and
//! control frames, and reads each `LayerData` payload straight from the
//! stream into a buffer of its own, taken from [`Buffers`]. So the
//! socket-to-buffer copy is the only copy before the [`BlockSink`](super::BlockSink),
//! and the buffer, handed to the sink by value, comes back to the pool when
//! the sink drops it (on whatever thread that is). The payload's CRC-32C is
//! computed read by read, over the bytes each read just put into that buffer
//! (still in cache), and handed to
//! [`Receiver::on_layer_checked`](crate::Receiver::on_layer_checked), so the
//! receiver never makes a second pass over the payload.
//!
//! Writing: [`write_parts`] writes a frame from where its pieces already lie
//! (header buffer, K range, V range) with vectored writes.

use std::io::{self, IoSlice};
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::time::timeout;

use crate::buffers::{Buffer, Buffers};
use crate::checksum;
use crate::frame::{DecodeError, DecodeLimits, DecodedHead, Frame, LayerDataHeader};

/// Bytes read ahead of the frame in progress. A read for the next header
/// also takes up to this much of the next payload, which is then copied once
/// more (into the payload's buffer): small, so that extra copy stays under
/// 1% of a 1 MiB frame, yet enough for any control frame.
const READ_AHEAD: usize = 8 << 10;

/// Most payload bytes one socket read takes. The checksum runs over each
/// read's bytes right after it, so a read should stay in L2 (1 MiB on the
/// machines measured); smaller reads cost more system calls and timers.
const READ_CHUNK: usize = 256 << 10;

/// Frames remembered per connection for de-duplication (aborts sent by the
/// server, acks and aborts received by the sender).
const REMEMBERED: usize = 64;

/// Why reading the next frame failed.
#[derive(Debug)]
pub(crate) enum ReadError {
    Io(io::Error),
    Idle(Duration),
    Decode(DecodeError),
    /// EOF inside a frame.
    Truncated,
}

/// A frame's start as [`FrameReader::next_head`] yields it.
#[derive(Debug)]
pub(crate) enum Head {
    /// Any frame but a `LayerData`, whole.
    Frame(Frame),
    /// A `LayerData`'s header; its payload is next on the stream.
    Layer(LayerDataHeader),
}

/// Reads whole frames from a stream. Holds at most [`READ_AHEAD`] bytes
/// (or one control frame, at most ~1 KiB) beyond the payload being read,
/// whose size the decode limits bound before any of it is read.
#[derive(Debug)]
pub(crate) struct FrameReader {
    buf: Vec<u8>,
    start: usize,
    end: usize,
    limits: DecodeLimits,
    payloads: Buffers,
}

impl FrameReader {
    pub(crate) fn new(limits: DecodeLimits, payloads: Buffers) -> Self {
        Self { buf: vec![0; READ_AHEAD], start: 0, end: 0, limits, payloads }
    }

    fn is_empty(&self) -> bool {
        self.start == self.end
    }

    /// The next frame if it is already buffered whole (never a `LayerData`
    /// with a payload: those are read from the stream).
    pub(crate) fn decode(&mut self) -> Result<Option<Frame>, DecodeError> {
        match Frame::decode_head(&self.buf[self.start..self.end], &self.limits)? {
            DecodedHead::Frame { frame, consumed } => {
                self.start += consumed;
                Ok(Some(frame))
            }
            DecodedHead::LayerData { header, consumed } if header.payload_len == 0 => {
                self.start += consumed;
                Ok(Some(Frame::LayerData(header.with_payload(Vec::new()))))
            }
            DecodedHead::LayerData { .. } | DecodedHead::NeedMore { .. } => Ok(None),
        }
    }

    /// Free room at the end of the read-ahead buffer, after moving what is
    /// buffered to its front if the room ran out.
    fn space(&mut self) -> &mut [u8] {
        if self.is_empty() {
            (self.start, self.end) = (0, 0);
        } else if self.end == self.buf.len() && self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            (self.start, self.end) = (0, self.end - self.start);
        } else if self.end == self.buf.len() {
            // Cannot happen (a buffered frame head is always decodable
            // within READ_AHEAD bytes); grow rather than report a 0-byte read as EOF.
            self.buf.resize(self.buf.len() + READ_AHEAD, 0);
        }
        &mut self.buf[self.end..]
    }

    /// Reads until a whole frame is there. `Ok(None)`: the peer closed
    /// cleanly between frames. Each read waits at most `idle`.
    /// For a reader with no use for a payload's checksum (a sender
    /// reading its peer's answers, which never carry one).
    pub(crate) async fn next<R>(&mut self, stream: &mut R, idle: Duration) -> Result<Option<Frame>, ReadError>
    where
        R: AsyncRead + Unpin + ?Sized,
    {
        Ok(match self.next_head(stream, idle).await? {
            None => None,
            Some(Head::Frame(f)) => Some(f),
            Some(Head::Layer(header)) => {
                let (mut payload, _) = self.read_payload(stream, header.payload_len, idle).await?;
                Some(Frame::LayerData(header.with_payload(std::mem::take(&mut *payload))))
            }
        })
    }

    /// Reads until a whole frame, or a `LayerData`'s header, is there; a
    /// [`Head::Layer`]'s payload is the stream's next `payload_len` bytes,
    /// which the caller reads next ([`read_payload`](Self::read_payload),
    /// or into place with [`take_buffered`](Self::take_buffered) and its own
    /// reads). `Ok(None)`: the peer closed cleanly between frames.
    pub(crate) async fn next_head<R>(&mut self, stream: &mut R, idle: Duration) -> Result<Option<Head>, ReadError>
    where
        R: AsyncRead + Unpin + ?Sized,
    {
        loop {
            match Frame::decode_head(&self.buf[self.start..self.end], &self.limits).map_err(ReadError::Decode)? {
                DecodedHead::Frame { frame, consumed } => {
                    self.start += consumed;
                    return Ok(Some(Head::Frame(frame)));
                }
                DecodedHead::LayerData { header, consumed } => {
                    self.start += consumed;
                    return Ok(Some(Head::Layer(header)));
                }
                DecodedHead::NeedMore { .. } => {}
            }
            // Control frames fit the buffer (at most HEADER_LEN + 1 KiB), so
            // there is always room for the rest of one.
            match read_within(stream, self.space(), idle).await? {
                0 if self.is_empty() => return Ok(None),
                0 => return Err(ReadError::Truncated),
                n => self.end += n,
            }
        }
    }

    /// Reads a payload of `len` bytes into a buffer of its own, with its
    /// CRC-32C.
    pub(crate) async fn read_payload<R>(
        &mut self,
        stream: &mut R,
        len: usize,
        idle: Duration,
    ) -> Result<(Buffer, u32), ReadError>
    where
        R: AsyncRead + Unpin + ?Sized,
    {
        let mut payload = self.payloads.take_sized(len);
        let have = self.take_buffered(len);
        payload[..have.len()].copy_from_slice(have);
        let mut filled = have.len();
        let mut crc = checksum::crc32c_append(0, &payload[..filled]);
        while filled < payload.len() {
            let upto = payload.len().min(filled + READ_CHUNK);
            match read_within(stream, &mut payload[filled..upto], idle).await? {
                0 => return Err(ReadError::Truncated),
                n => {
                    // Checksummed as read, while still in cache, from our
                    // own buffer: what the sink will get.
                    crc = checksum::crc32c_append(crc, &payload[filled..filled + n]);
                    filled += n;
                }
            }
        }
        Ok((payload, crc))
    }

    /// Up to `max` bytes already read ahead, taken: the front of a payload
    /// whose header [`next_head`](Self::next_head) returned.
    pub(crate) fn take_buffered(&mut self, max: usize) -> &[u8] {
        let n = (self.end - self.start).min(max);
        let at = self.start;
        self.start += n;
        &self.buf[at..at + n]
    }

    /// One read of whatever the stream has ready, without waiting:
    /// `Some(0)` if nothing is, `None` if the peer closed.
    pub(crate) fn read_ready<R>(&mut self, stream: &mut R) -> io::Result<Option<usize>>
    where
        R: AsyncRead + Unpin + ?Sized,
    {
        let mut rb = ReadBuf::new(self.space());
        // A no-op waker: nothing waits on this poll; the next real read
        // registers its own waker.
        match Pin::new(&mut *stream).poll_read(&mut Context::from_waker(Waker::noop()), &mut rb) {
            Poll::Pending => Ok(Some(0)),
            Poll::Ready(Err(e)) => Err(e),
            Poll::Ready(Ok(())) if rb.filled().is_empty() => Ok(None),
            Poll::Ready(Ok(())) => {
                let n = rb.filled().len();
                self.end += n;
                Ok(Some(n))
            }
        }
    }
}

async fn read_within<R>(stream: &mut R, buf: &mut [u8], idle: Duration) -> Result<usize, ReadError>
where
    R: AsyncRead + Unpin + ?Sized,
{
    match timeout(idle, stream.read(buf)).await {
        Err(_) => Err(ReadError::Idle(idle)),
        Ok(Err(e)) => Err(ReadError::Io(e)),
        Ok(Ok(n)) => Ok(n),
    }
}

/// Why a write did not finish.
#[derive(Debug)]
pub(crate) enum WriteError {
    Io(io::Error),
    Timeout(Duration),
}

/// Writes every byte of `parts`, in order, with vectored writes, within `wait`.
pub(crate) async fn write_parts<W, const N: usize>(
    stream: &mut W,
    parts: [&[u8]; N],
    wait: Duration,
) -> Result<(), WriteError>
where
    W: AsyncWrite + Unpin + ?Sized,
{
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let all = async {
        let mut done = 0;
        while done < total {
            let mut slices: [IoSlice<'_>; N] = std::array::from_fn(|_| IoSlice::new(&[]));
            let (mut skip, mut k) = (done, 0);
            for p in parts {
                if skip >= p.len() {
                    skip -= p.len();
                    continue;
                }
                slices[k] = IoSlice::new(&p[skip..]);
                skip = 0;
                k += 1;
            }
            let n = stream.write_vectored(&slices[..k]).await?;
            if n == 0 {
                return Err(io::Error::from(io::ErrorKind::WriteZero));
            }
            done += n;
        }
        Ok(())
    };
    match timeout(wait, all).await {
        Err(_) => Err(WriteError::Timeout(wait)),
        Ok(r) => r.map_err(WriteError::Io),
    }
}

/// Encodes a small control frame into `out` and writes it.
pub(crate) async fn write_frame<W>(
    stream: &mut W,
    out: &mut Vec<u8>,
    f: &Frame,
    wait: Duration,
) -> Result<(), WriteError>
where
    W: AsyncWrite + Unpin + ?Sized,
{
    out.clear();
    // Only LayerData can fail to encode; control frames are fixed-size.
    f.encode(out).map_err(|e| WriteError::Io(io::Error::new(io::ErrorKind::InvalidInput, e)))?;
    write_parts(stream, [out.as_slice()], wait).await
}

pub(crate) fn frame_name(f: &Frame) -> &'static str {
    match f {
        Frame::Hello(_) => "Hello",
        Frame::HelloAck(_) => "HelloAck",
        Frame::HelloReject(_) => "HelloReject",
        Frame::LayerData(_) => "LayerData",
        Frame::Complete(_) => "Complete",
        Frame::Ack(_) => "Ack",
        Frame::Abort(_) => "Abort",
    }
}

/// Bounded memory of recent items, oldest forgotten first.
#[derive(Debug)]
pub(crate) struct Recent<T>(pub(crate) std::collections::VecDeque<T>);

impl<T> Default for Recent<T> {
    fn default() -> Self {
        Self(std::collections::VecDeque::new())
    }
}

impl<T: PartialEq> Recent<T> {
    pub(crate) fn push(&mut self, t: T) {
        if self.0.len() == REMEMBERED {
            self.0.pop_front();
        }
        self.0.push_back(t);
    }
    pub(crate) fn contains(&self, t: &T) -> bool {
        self.0.contains(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{Complete, LayerData, LAYER_DATA_OVERHEAD};

    /// A payload larger than several reads, fed through a pipe that hands
    /// it over in small, uneven pieces, and a control frame behind it: the
    /// reader's checksum is the payload's, read by read, whatever it holds.
    #[tokio::test]
    async fn payload_checksum_is_computed_as_it_is_read() {
        let payload: Vec<u8> = (0..3 * READ_CHUNK + 12_345).map(|i| (i * 31 + i / 7) as u8).collect();
        let good = LayerData::new(5, 6, 1, 2, 3, payload.clone());
        let mut corrupt = good.clone();
        corrupt.payload[2 * READ_CHUNK + 1] ^= 0x10;
        let c = Frame::Complete(Complete { reservation: 5, generation: 6, n_layers: 2 });
        let mut wire = Vec::new();
        for f in [Frame::LayerData(good.clone()), Frame::LayerData(corrupt.clone()), c.clone()] {
            f.encode(&mut wire).expect("encode");
        }
        assert_eq!(wire.len(), 2 * (LAYER_DATA_OVERHEAD + payload.len()) + c.encoded_len());
        let (mut tx, mut rx) = tokio::io::duplex(4099);
        let writer = tokio::spawn(async move { tx.write_all(&wire).await });
        let limits = DecodeLimits { max_payload_bytes: 1 << 20 };
        let mut reader = FrameReader::new(limits, Buffers::new(0));
        let idle = Duration::from_secs(10);
        for sent in [&good, &corrupt] {
            match reader.next_head(&mut rx, idle).await.expect("read") {
                Some(Head::Layer(header)) => {
                    assert_eq!(header, sent.header());
                    let (payload, crc32c) =
                        reader.read_payload(&mut rx, header.payload_len, idle).await.expect("payload");
                    assert_eq!(*payload, sent.payload);
                    assert_eq!(crc32c, crc32c::crc32c(&sent.payload));
                }
                other => panic!("expected a LayerData, got {other:?}"),
            }
        }
        assert_eq!(good.checksum, crc32c::crc32c(&good.payload));
        assert_ne!(corrupt.checksum, crc32c::crc32c(&corrupt.payload), "the second frame is corrupt");
        assert!(matches!(reader.next(&mut rx, idle).await.expect("read"), Some(f) if f == c));
        writer.await.expect("writer").expect("write");
        assert!(reader.next(&mut rx, idle).await.expect("read").is_none(), "clean end");
    }
}
