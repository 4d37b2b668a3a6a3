//! The primitive encoding every message is built from: big-endian
//! integers, strings with a `u16` or `u32` length, and bounded element
//! counts, with one error type for whatever a peer gets wrong.

use crate::limits::{MAX_CHUNKS, MAX_FRAME};

/// A malformed or out-of-bounds message from a peer.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WireError {
    /// The buffer ended before the message did.
    #[error("message truncated: needed {needed} more bytes for {what}")]
    Truncated {
        /// What was being decoded.
        what: &'static str,
        /// How many more bytes were needed.
        needed: usize,
    },
    /// A length field exceeds its bound.
    #[error("{what} of {got} exceeds the limit of {limit}")]
    TooLarge {
        /// Which length.
        what: &'static str,
        /// The value sent.
        got: u64,
        /// The bound.
        limit: u64,
    },
    /// Unknown message type byte.
    #[error("unknown control message type {0}")]
    UnknownType(u8),
    /// A string was not UTF-8.
    #[error("{0} is not valid UTF-8")]
    Utf8(&'static str),
    /// Bytes left over after a complete message.
    #[error("{0} trailing bytes after message")]
    Trailing(usize),
    /// Data stream does not start with [`crate::wire::DATA_MAGIC`].
    #[error("data stream does not start with the Ferry magic bytes")]
    BadMagic,
    /// A field holds a value that cannot be right.
    #[error("invalid {what}: {why}")]
    Invalid {
        /// Which field.
        what: &'static str,
        /// Why it is invalid.
        why: String,
    },
}

/// Big-endian byte writer used by the encoders.
pub(crate) struct Writer(pub(crate) Vec<u8>);

impl Writer {
    pub(crate) fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    pub(crate) fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_be_bytes());
    }
    pub(crate) fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_be_bytes());
    }
    pub(crate) fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_be_bytes());
    }
    pub(crate) fn i64(&mut self, v: i64) {
        self.0.extend_from_slice(&v.to_be_bytes());
    }
    /// A short string (`u16` length); longer input is cut at a char boundary.
    pub(crate) fn str(&mut self, s: &str) {
        let s = truncate(s, u16::MAX as usize);
        self.u16(s.len() as u16);
        self.0.extend_from_slice(s.as_bytes());
    }
    /// A long string (`u32` length).
    pub(crate) fn long_str(&mut self, s: &str) {
        let s = truncate(s, MAX_FRAME / 2);
        self.u32(s.len() as u32);
        self.0.extend_from_slice(s.as_bytes());
    }
    /// A list of chunk keys or other `u64`s (`u32` count, then `u64`
    /// each).
    pub(crate) fn indices(&mut self, v: &[u64]) {
        self.u32(v.len() as u32);
        for i in v {
            self.u64(*i);
        }
    }
}

fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Bounds-checked big-endian reader used by the decoders.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }
    pub(crate) fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], WireError> {
        let left = self.buf.len() - self.pos;
        if n > left {
            return Err(WireError::Truncated {
                what,
                needed: n - left,
            });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    pub(crate) fn u8(&mut self, what: &'static str) -> Result<u8, WireError> {
        Ok(self.take(1, what)?[0])
    }
    pub(crate) fn u16(&mut self, what: &'static str) -> Result<u16, WireError> {
        let b = self.take(2, what)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }
    pub(crate) fn u32(&mut self, what: &'static str) -> Result<u32, WireError> {
        let b = self.take(4, what)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    pub(crate) fn u64(&mut self, what: &'static str) -> Result<u64, WireError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8, what)?);
        Ok(u64::from_be_bytes(a))
    }
    pub(crate) fn i64(&mut self, what: &'static str) -> Result<i64, WireError> {
        Ok(self.u64(what)? as i64)
    }
    pub(crate) fn hash(&mut self, what: &'static str) -> Result<[u8; 32], WireError> {
        let mut h = [0u8; 32];
        h.copy_from_slice(self.take(32, what)?);
        Ok(h)
    }
    pub(crate) fn str(&mut self, what: &'static str) -> Result<String, WireError> {
        let n = self.u16(what)? as usize;
        let b = self.take(n, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| WireError::Utf8(what))
    }
    pub(crate) fn long_str(&mut self, what: &'static str) -> Result<String, WireError> {
        let n = self.u32(what)? as usize;
        if n > MAX_FRAME {
            return Err(WireError::TooLarge {
                what,
                got: n as u64,
                limit: MAX_FRAME as u64,
            });
        }
        let b = self.take(n, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| WireError::Utf8(what))
    }
    /// Reads a `u32` element count, bounded by `limit` and by what the rest
    /// of the buffer can hold at `min_elem` bytes per element, so a hostile
    /// count cannot make the decoder allocate more than the frame size.
    pub(crate) fn count(
        &mut self,
        what: &'static str,
        limit: u32,
        min_elem: usize,
    ) -> Result<usize, WireError> {
        let n = self.u32(what)?;
        if n > limit {
            return Err(WireError::TooLarge {
                what,
                got: n.into(),
                limit: limit.into(),
            });
        }
        let n = n as usize;
        if n.saturating_mul(min_elem) > self.remaining() {
            return Err(WireError::Truncated {
                what,
                needed: n * min_elem - self.remaining(),
            });
        }
        Ok(n)
    }
    /// A list of chunk keys, at most [`MAX_CHUNKS`].
    pub(crate) fn indices(&mut self) -> Result<Vec<u64>, WireError> {
        self.indices_named("chunk index count", "chunk index")
    }
    /// A list of `u64`s (`u32` count, then each), at most [`MAX_CHUNKS`];
    /// errors name the count `count` and an element `elem`.
    pub(crate) fn indices_named(
        &mut self,
        count: &'static str,
        elem: &'static str,
    ) -> Result<Vec<u64>, WireError> {
        let n = self.count(count, MAX_CHUNKS, 8)?;
        (0..n).map(|_| self.u64(elem)).collect()
    }
    pub(crate) fn finish(&self) -> Result<(), WireError> {
        match self.remaining() {
            0 => Ok(()),
            n => Err(WireError::Trailing(n)),
        }
    }
}
