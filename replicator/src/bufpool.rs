//! A bounded pool of chunk buffers, reused instead of freshly allocated.
//!
//! Both agents move every chunk through a heap buffer: the source reads a
//! chunk into one and hands it to quinn, the sink copies a chunk out of
//! quinn into one and writes it to staging. A fresh multi-MiB allocation
//! per chunk is served by `mmap` or by heap the allocator has just trimmed,
//! so every page of it faults on first touch: the CPU profile in
//! `ops/bench/RESULTS.md` ("CPU profile of one agent pair") put those page
//! faults at 4-6 % of the source's samples and 3 % of the sink's. A pool
//! keeps up to [`BufPool::new`]'s byte budget of released buffers warm.

use std::sync::{Arc, Mutex};

use bytes::Bytes;

/// The byte budget of each agent's chunk pool: 16 chunks of the default
/// 4 MiB, a small part of the 512 MiB resident-memory goal of
/// `ops/bench` (its `peak_rss` rows).
pub const AGENT_POOL_BYTES: usize = 64 << 20;

/// Buffers with less capacity than this (bytes) are not kept: the
/// allocator serves them from its bins without faulting.
const MIN_KEEP: usize = 64 << 10;

/// A pool of byte buffers, shared between threads.
#[derive(Debug)]
pub struct BufPool {
    free: Mutex<Free>,
    max_bytes: usize,
}

#[derive(Debug, Default)]
struct Free {
    bufs: Vec<Vec<u8>>,
    /// Sum of the capacities in `bufs`, bytes.
    bytes: usize,
}

impl BufPool {
    /// A pool that keeps at most `max_bytes` bytes of capacity in
    /// released buffers (more is freed).
    pub fn new(max_bytes: usize) -> Arc<BufPool> {
        Arc::new(BufPool {
            free: Mutex::new(Free::default()),
            max_bytes,
        })
    }

    /// An empty buffer (`len` 0) with capacity for at least `len` bytes:
    /// a released one when the pool holds one large enough, else a new one.
    pub fn take(&self, len: usize) -> Vec<u8> {
        if len >= MIN_KEEP {
            let mut free = crate::lock::lock(&self.free);
            // The smallest buffer that fits, so large ones stay for large
            // chunks.
            let best = free
                .bufs
                .iter()
                .enumerate()
                .filter(|(_, b)| b.capacity() >= len)
                .min_by_key(|(_, b)| b.capacity())
                .map(|(i, _)| i);
            if let Some(i) = best {
                let mut b = free.bufs.swap_remove(i);
                free.bytes -= b.capacity();
                drop(free);
                b.clear();
                return b;
            }
        }
        Vec::with_capacity(len)
    }

    /// Returns `buf` to the pool, or frees it when it is small or the
    /// pool's budget is spent.
    pub fn give(&self, buf: Vec<u8>) {
        let cap = buf.capacity();
        if cap < MIN_KEEP || cap > self.max_bytes {
            return;
        }
        let mut free = crate::lock::lock(&self.free);
        if free.bytes + cap <= self.max_bytes {
            free.bytes += cap;
            free.bufs.push(buf);
        }
    }

    /// `buf` as [`Bytes`] that returns it to this pool when the last
    /// reference is dropped (when quinn has had the bytes acknowledged).
    pub fn bytes(self: &Arc<Self>, buf: Vec<u8>) -> Bytes {
        Bytes::from_owner(Pooled {
            buf,
            pool: self.clone(),
        })
    }

    /// Bytes of capacity held in released buffers now.
    pub fn held_bytes(&self) -> usize {
        crate::lock::lock(&self.free).bytes
    }
}

/// A buffer on loan from a [`BufPool`], as the owner of a [`Bytes`].
struct Pooled {
    buf: Vec<u8>,
    pool: Arc<BufPool>,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        self.pool.give(std::mem::take(&mut self.buf));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_released_buffer_is_reused_without_a_new_allocation() {
        let pool = BufPool::new(16 << 20);
        let mut a = pool.take(4 << 20);
        a.extend_from_slice(&[7u8; 100]);
        let ptr = a.as_ptr();
        pool.give(a);
        assert_eq!(pool.held_bytes(), 4 << 20);
        let b = pool.take(1 << 20);
        assert_eq!(b.as_ptr(), ptr, "the released buffer comes back");
        assert!(b.is_empty(), "a reused buffer starts empty");
        assert_eq!(pool.held_bytes(), 0);
    }

    #[test]
    fn the_budget_and_the_small_size_bound_what_is_kept() {
        let pool = BufPool::new(8 << 20);
        pool.give(Vec::with_capacity(1024));
        assert_eq!(pool.held_bytes(), 0, "small buffers are freed");
        pool.give(Vec::with_capacity(4 << 20));
        pool.give(Vec::with_capacity(4 << 20));
        pool.give(Vec::with_capacity(4 << 20));
        assert_eq!(pool.held_bytes(), 8 << 20, "the third is over budget");
        // Too large for any held buffer: a new one.
        let big = pool.take(6 << 20);
        assert!(big.capacity() >= 6 << 20);
        assert_eq!(pool.held_bytes(), 8 << 20);
    }

    #[test]
    fn the_smallest_fitting_buffer_is_taken() {
        let pool = BufPool::new(64 << 20);
        pool.give(Vec::with_capacity(16 << 20));
        pool.give(Vec::with_capacity(1 << 20));
        let b = pool.take(512 << 10);
        assert!(b.capacity() < 16 << 20, "got {}", b.capacity());
        assert_eq!(pool.held_bytes(), 16 << 20);
    }

    #[test]
    fn bytes_return_their_buffer_when_the_last_clone_drops() {
        let pool = BufPool::new(16 << 20);
        let mut v = pool.take(1 << 20);
        v.resize(1 << 20, 3);
        let b = pool.bytes(v);
        let c = b.slice(10..20);
        drop(b);
        assert_eq!(pool.held_bytes(), 0, "a slice still holds it");
        assert_eq!(&c[..], &[3u8; 10]);
        drop(c);
        assert_eq!(pool.held_bytes(), 1 << 20);
    }
}
