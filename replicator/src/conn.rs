//! Framing of [`Control`] messages on a QUIC control stream, shared by the
//! sender and the receiver.

use ferry_proto::wire::{frame_len, Control, WireError};
use quinn::{ReadExactError, RecvStream, SendStream};
use tokio::sync::Mutex;

/// QUIC application error codes Ferry closes connections and streams with.
pub mod code {
    /// Normal close (shutdown).
    pub const DONE: u32 = 0;
    /// The peer broke the protocol (bad frame, bad record, bad version).
    pub const PROTOCOL: u32 = 1;
    /// The peer's certificate name is not accepted here.
    pub const NOT_ACCEPTED: u32 = 2;
    /// A data stream for a transfer this connection does not know.
    pub const UNKNOWN_TRANSFER: u32 = 3;
    /// The agent is shutting down.
    pub const SHUTDOWN: u32 = 4;
    /// Data for a transfer the sink refused.
    pub const REFUSED: u32 = 5;
    /// A batch the source gave up (its commit lists it as lost, protocol
    /// version 4), arriving after that commit: not read.
    pub const LOST_BATCH: u32 = 6;
}

/// Errors on a control stream.
#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    /// The peer sent a malformed frame.
    #[error("protocol error from peer: {0}")]
    Wire(#[from] WireError),
    /// The stream or connection failed.
    #[error("connection: {0}")]
    Read(#[from] quinn::ReadExactError),
    /// Writing failed.
    #[error("connection: {0}")]
    Write(#[from] quinn::WriteError),
    /// The connection was lost.
    #[error("connection: {0}")]
    Connection(#[from] quinn::ConnectionError),
    /// The peer said something that makes no sense at this point.
    #[error("protocol error from peer: {0}")]
    Unexpected(String),
    /// The peer refused the connection or transfer.
    #[error("peer: {0}")]
    Peer(String),
    /// This end cannot go on with the transfer (it is stopping).
    #[error("{0}")]
    Local(String),
}

/// Reads exactly `len` bytes from `recv` into `buf` (emptied first, its
/// capacity reused: a buffer from a [`crate::bufpool::BufPool`]), copying
/// them once from quinn's buffers (no zero fill).
///
/// # Errors
/// [`ReadExactError::FinishedEarly`] with the bytes read if the stream ends
/// first; [`ReadExactError::ReadError`] if it fails.
pub async fn read_into(
    recv: &mut RecvStream,
    len: usize,
    buf: &mut Vec<u8>,
) -> Result<(), ReadExactError> {
    buf.clear();
    buf.reserve(len);
    while buf.len() < len {
        match recv.read_chunk(len - buf.len(), true).await {
            Ok(Some(c)) => buf.extend_from_slice(&c.bytes),
            Ok(None) => return Err(ReadExactError::FinishedEarly(buf.len())),
            Err(e) => return Err(ReadExactError::ReadError(e)),
        }
    }
    Ok(())
}

/// Reads one control frame; `Ok(None)` when the peer finished the stream
/// cleanly between frames.
///
/// # Errors
/// [`ConnError`] for a truncated or malformed frame or a failed stream.
pub async fn read_frame(recv: &mut RecvStream) -> Result<Option<Control>, ConnError> {
    let mut prefix = [0u8; 4];
    match recv.read_exact(&mut prefix).await {
        Ok(()) => {}
        Err(ReadExactError::FinishedEarly(0)) => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let len = frame_len(prefix)?;
    let mut body = vec![0u8; len];
    recv.read_exact(&mut body).await?;
    Ok(Some(Control::decode(&body)?))
}

/// QUIC stream priority of the control stream: above every data stream
/// (data streams use 0..=2 by class).
pub const CONTROL_PRIORITY: i32 = 16;

/// The sending half of a control stream, shareable between tasks.
#[derive(Debug)]
pub struct ControlSender(Mutex<SendStream>);

impl ControlSender {
    /// Wraps a stream.
    pub fn new(s: SendStream) -> Self {
        // Control messages are small and gate everything else (an open
        // before its data, a commit before the publish): they go before
        // any data stream, urgent ones included.
        let _ = s.set_priority(CONTROL_PRIORITY);
        ControlSender(Mutex::new(s))
    }

    /// Sends one message.
    ///
    /// # Errors
    /// [`ConnError::Write`] if the stream is gone.
    pub async fn send(&self, msg: &Control) -> Result<(), ConnError> {
        tracing::trace!(msg = msg.name(), "control send");
        self.0.lock().await.write_all(&msg.encode()).await?;
        Ok(())
    }

    /// Sends a last message, finishes the stream and waits (at most
    /// `wait`) until the peer has read it, so that closing the connection
    /// right after does not discard it.
    pub async fn send_last(&self, msg: &Control, wait: std::time::Duration) {
        let mut s = self.0.lock().await;
        if s.write_all(&msg.encode()).await.is_ok() && s.finish().is_ok() {
            let _ = tokio::time::timeout(wait, s.stopped()).await;
        }
    }
}
