//! The prefill worker's side: one connection to a decode worker.

use std::io;
use std::time::Duration;

use engine::kv::KvLayout;
use tokio::net::{TcpStream, ToSocketAddrs};
use tokio::time::timeout;

use crate::frame::{
    Abort, AbortReason, Ack, Complete, DecodeLimits, Frame, Hello, LayerDataHeader, RejectReason, LAYER_DATA_OVERHEAD,
};
use crate::sender::SplitError;
use crate::session::{Peer, Reservation};
use crate::ErrorKind;

use super::{
    frame_name, write_frame, write_parts, FrameReader, ReadError, Recent, WriteError, DEFAULT_MAX_FRAME_BYTES,
};

/// Why a send failed. Each variant has a [`kind`](Self::kind) the caller
/// acts on (`kv_load_failure_policy`).
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// Connecting, reading or writing failed, or the receiver closed the connection.
    #[error("connection: {0}")]
    Io(#[from] io::Error),
    /// The receiver refused the handshake: protocol version, version group
    /// or layout fingerprint differ. Retrying the same pair fails again.
    #[error("handshake rejected: {}", reason.as_str())]
    Rejected { reason: RejectReason },
    /// Something did not happen in time.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout { what: &'static str, after: Duration },
    /// The receiver said something the protocol does not allow here.
    #[error("protocol: {0}")]
    Protocol(String),
    /// The receiver refused the transfer (lease expired, corrupt frame, …).
    #[error("receiver aborted the transfer: {}", reason.as_str())]
    PeerAbort { reason: AbortReason },
    /// The caller's K/V bytes do not fit the layout (a local bug).
    #[error("layer not sendable: {0}")]
    Layer(#[from] SplitError),
}

impl TransferError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Io(_) => ErrorKind::Retryable,
            Self::Rejected { reason } => reason.kind(),
            Self::Timeout { .. } => ErrorKind::Deadline,
            Self::Protocol(_) | Self::Layer(_) => ErrorKind::InvalidInput,
            Self::PeerAbort { reason } => reason.kind(),
        }
    }

    fn write(e: WriteError, what: &'static str) -> Self {
        match e {
            WriteError::Io(e) => Self::Io(e),
            WriteError::Timeout(after) => Self::Timeout { what, after },
        }
    }

    fn read(e: ReadError, what: &'static str) -> Self {
        match e {
            ReadError::Io(e) => Self::Io(e),
            ReadError::Idle(after) => Self::Timeout { what, after },
            ReadError::Decode(e) => Self::Protocol(format!("undecodable bytes from the receiver: {e}")),
            ReadError::Truncated => Self::Io(io::Error::new(io::ErrorKind::UnexpectedEof, "receiver closed mid-frame")),
        }
    }
}

/// Sender settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpSenderConfig {
    /// Limit for connecting, the handshake, each frame's write and waiting for an `Ack`.
    pub timeout: Duration,
    /// Largest encoded `LayerData` frame written (whole blocks per frame).
    pub max_frame_bytes: usize,
}

impl Default for TcpSenderConfig {
    /// 10 s, [`DEFAULT_MAX_FRAME_BYTES`].
    fn default() -> Self {
        Self { timeout: Duration::from_secs(10), max_frame_bytes: DEFAULT_MAX_FRAME_BYTES }
    }
}

/// The prefill worker's end of one connection to a decode worker.
#[derive(Debug)]
pub struct TcpKvSender {
    stream: TcpStream,
    layout: KvLayout,
    config: TcpSenderConfig,
    reader: FrameReader,
    out: Vec<u8>,
    /// Aborts and acks that arrived before the caller asked about them.
    aborts: Recent<Abort>,
    acks: Recent<Ack>,
    bytes_sent: u64,
}

impl TcpKvSender {
    /// Connects and does the handshake as `local`, whose KV has `layout`.
    pub async fn connect(
        addr: impl ToSocketAddrs,
        local: &Peer,
        layout: KvLayout,
        config: TcpSenderConfig,
    ) -> Result<Self, TransferError> {
        let wait = config.timeout;
        let stream = timeout(wait, TcpStream::connect(addr))
            .await
            .map_err(|_| TransferError::Timeout { what: "TCP connect", after: wait })??;
        stream.set_nodelay(true)?;
        // The receiver only sends small control frames.
        let reader = FrameReader::new(DecodeLimits { max_payload_bytes: 0 });
        let mut s = Self {
            stream,
            layout,
            config,
            reader,
            out: Vec::with_capacity(LAYER_DATA_OVERHEAD),
            aborts: Recent::default(),
            acks: Recent::default(),
            bytes_sent: 0,
        };
        let hello = Frame::Hello(Hello {
            version_group: local.version_group.clone(),
            fingerprint: local.fingerprint,
            protocol_version: crate::PROTOCOL_VERSION,
        });
        write_frame(&mut s.stream, &mut s.out, &hello, wait)
            .await
            .map_err(|e| TransferError::write(e, "sending Hello"))?;
        match s.reader.next(&mut s.stream, wait).await.map_err(|e| TransferError::read(e, "HelloAck"))? {
            Some(Frame::HelloAck(a)) if a.protocol_version == crate::PROTOCOL_VERSION => Ok(s),
            Some(Frame::HelloAck(a)) => {
                Err(TransferError::Protocol(format!("HelloAck for protocol version {}", a.protocol_version)))
            }
            Some(Frame::HelloReject(r)) => Err(TransferError::Rejected { reason: r.reason }),
            Some(other) => Err(TransferError::Protocol(format!("{} instead of HelloAck", frame_name(&other)))),
            None => Err(TransferError::Io(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "receiver closed the connection during the handshake",
            ))),
        }
    }

    /// Payload and header bytes written so far.
    pub fn bytes_sent(&self) -> u64 {
        self.bytes_sent
    }

    /// Sends one layer's K and V of the reservation's blocks (as
    /// [`KvPool::gather_layer`](engine::kv::KvPool::gather_layer) returns
    /// them), cut into frames of whole blocks as
    /// [`split_layer`](crate::split_layer) cuts them, written without
    /// copying the payload. Fails fast with
    /// [`PeerAbort`](TransferError::PeerAbort) if the receiver already
    /// refused this reservation.
    pub async fn send_layer(&mut self, r: Reservation, layer: usize, k: &[u8], v: &[u8]) -> Result<(), TransferError> {
        let l = &self.layout;
        if layer >= l.n_layers || layer > u32::MAX as usize {
            return Err(SplitError::LayerOutOfRange { layer, n_layers: l.n_layers }.into());
        }
        let side = l.block_elems() * l.dtype.size();
        if side == 0 || k.is_empty() || k.len() != v.len() || k.len() % side != 0 {
            return Err(SplitError::Shape { len: k.len() + v.len(), per_block: 2 * side }.into());
        }
        let n_blocks = k.len() / side;
        if n_blocks > u32::MAX as usize {
            return Err(SplitError::TooManyBlocks { n_blocks }.into());
        }
        let max = self.config.max_frame_bytes;
        let per_frame = max.saturating_sub(LAYER_DATA_OVERHEAD) / (2 * side);
        if per_frame == 0 {
            return Err(
                SplitError::FrameTooSmall { max_frame_bytes: max, needed: LAYER_DATA_OVERHEAD + 2 * side }.into()
            );
        }
        let mut first = 0;
        while first < n_blocks {
            self.check_not_aborted(r)?;
            let n = per_frame.min(n_blocks - first);
            let range = first * side..(first + n) * side;
            let (kr, vr) = (&k[range.clone()], &v[range]);
            let header = LayerDataHeader {
                reservation: r.id.0,
                generation: r.generation,
                // Both checked to fit u32 above.
                layer: layer as u32,
                first_block: first as u32,
                n_blocks: n as u32,
                checksum: crc32c::crc32c_append(crc32c::crc32c(kr), vr),
                payload_len: 2 * kr.len(),
            };
            self.out.clear();
            header.encode(&mut self.out).map_err(|e| TransferError::Protocol(e.to_string()))?;
            write_parts(&mut self.stream, [self.out.as_slice(), kr, vr], self.config.timeout)
                .await
                .map_err(|e| TransferError::write(e, "writing a LayerData frame"))?;
            self.bytes_sent += (LAYER_DATA_OVERHEAD + 2 * kr.len()) as u64;
            first += n;
        }
        Ok(())
    }

    /// Says every layer was sent and waits (up to the configured timeout)
    /// for the receiver's `Ack`. After `Ok` the sender may drop its copy.
    pub async fn complete(&mut self, r: Reservation) -> Result<Ack, TransferError> {
        self.check_not_aborted(r)?;
        let c = Frame::Complete(Complete {
            reservation: r.id.0,
            generation: r.generation,
            n_layers: self.layout.n_layers as u32,
        });
        let wait = self.config.timeout;
        write_frame(&mut self.stream, &mut self.out, &c, wait)
            .await
            .map_err(|e| TransferError::write(e, "sending Complete"))?;
        let want = Ack { reservation: r.id.0, generation: r.generation };
        let waiting = async {
            loop {
                if self.acks.contains(&want) {
                    return Ok(want);
                }
                self.check_aborted(r)?;
                match self.reader.next(&mut self.stream, wait).await.map_err(|e| TransferError::read(e, "Ack"))? {
                    Some(f) => self.note(f)?,
                    None => {
                        return Err(TransferError::Io(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "receiver closed the connection before acknowledging",
                        )))
                    }
                }
            }
        };
        timeout(wait, waiting).await.map_err(|_| TransferError::Timeout { what: "Ack", after: wait })?
    }

    /// Tells the receiver this transfer is abandoned (prefill failed, request cancelled).
    pub async fn abort(&mut self, r: Reservation, reason: AbortReason) -> Result<(), TransferError> {
        let a = Frame::Abort(Abort { reservation: r.id.0, generation: r.generation, reason });
        write_frame(&mut self.stream, &mut self.out, &a, self.config.timeout)
            .await
            .map_err(|e| TransferError::write(e, "sending Abort"))
    }

    /// Takes in whatever the receiver already sent, without waiting, then
    /// fails if it aborted `r`.
    fn check_not_aborted(&mut self, r: Reservation) -> Result<(), TransferError> {
        let drained = self.drain();
        self.check_aborted(r)?;
        drained
    }

    fn check_aborted(&self, r: Reservation) -> Result<(), TransferError> {
        match self.aborts.0.iter().find(|a| a.reservation == r.id.0 && a.generation == r.generation) {
            Some(a) => Err(TransferError::PeerAbort { reason: a.reason }),
            None => Ok(()),
        }
    }

    fn drain(&mut self) -> Result<(), TransferError> {
        loop {
            while let Some(f) = self.reader.decode().map_err(|e| TransferError::read(ReadError::Decode(e), ""))? {
                self.note(f)?;
            }
            match self.stream.try_read(self.reader.space()) {
                Ok(0) => {
                    return Err(TransferError::Io(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "receiver closed the connection",
                    )))
                }
                Ok(n) => self.reader.advance(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) => return Err(e.into()),
            }
        }
    }

    fn note(&mut self, f: Frame) -> Result<(), TransferError> {
        match f {
            Frame::Abort(a) => self.aborts.push(a),
            Frame::Ack(a) => self.acks.push(a),
            other => {
                return Err(TransferError::Protocol(format!("unexpected {} from the receiver", frame_name(&other))))
            }
        }
        Ok(())
    }
}
