//! The link's dispatcher: every transfer active on a link hands its ready
//! chunks here, and a few stream writers per connection ask the link's
//! [`LinkScheduler`] which one goes next (ARCHITECTURE.md "Bird's-eye view").
//! A link served by several connections has writers on each, all asking
//! the one scheduler: chunks are striped across the connections in the
//! order the scheduler picks them, each to the connection with the least
//! unsent bytes among those with a writer free (join the shortest queue;
//! the backlog is modelled from the bytes handed to each connection and
//! its congestion controller's share of the rate). Each connection's
//! controller aims at the link's rate divided by the connections, so
//! urgent chunks spread this way keep every connection busy with them,
//! and quinn's stream priorities (which act within one connection) put
//! them ahead of lower-class bytes on each.
//!
//! - A transfer's ready chunks wait in its queue (at most
//!   [`QUEUE_RECORDS`] records and [`QUEUE_BYTES`] bytes, so its reader
//!   stays a little ahead of the link); the scheduler knows their lengths.
//! - A writer asks the scheduler, takes the chosen chunk and writes it on a
//!   QUIC stream of that transfer (a batch) whose priority is the class's
//!   (urgent bytes leave first even when lower-class bytes are already
//!   buffered in quinn). A writer ends its batch when the next decision is
//!   for another transfer (a lower-class batch is cut at a chunk boundary
//!   the moment a higher class has data), when the batch is full, when the
//!   transfer has nothing more queued, and when the link is idle or
//!   waiting on its rate cap with nothing queued for that transfer.
//! - A transfer's send round ends with [`LinkSched::flush`]: every chunk it
//!   queued is written and every batch it opened is finished, so the batch
//!   count sent with the commit is exact.
//! - Each batch gets the next sequence number of its transfer's run
//!   (protocol version 4) and is kept, with the records written on it,
//!   until the sink confirms it ([`LinkSched::confirmed`]). When a
//!   connection other than the control one is lost, its unconfirmed
//!   batches are given up ([`LinkSched::connection_lost`]): their records
//!   go back to their transfers' queues, the writers of the other
//!   connections send them again as the scheduler picks them, and the
//!   commit lists the given-up sequence numbers so the sink does not wait
//!   for them. A record's bytes are shared with quinn's send buffer
//!   (`bytes::Bytes`), so keeping them costs memory only between quinn's
//!   acknowledgement and the sink's confirmation, about one round trip;
//!   the control connection's batches are not kept (its loss replaces the
//!   pool).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};

use ferry_catalog::now_ms;
use ferry_proto::state::TransferId;
use ferry_proto::wire::BatchHeader;
use quinn::{Connection, SendStream};
use scheduler::{Decision, LinkScheduler};
use tokio::sync::futures::Notified;
use tokio::sync::Notify;

use super::{LiveProgress, Record};
use crate::metrics::{class_index, LinkCounters};

/// Records a transfer may have queued before its reader waits.
pub const QUEUE_RECORDS: usize = 16;
/// Bytes a transfer may have queued before its reader waits (a larger
/// record is still accepted into an empty queue).
pub const QUEUE_BYTES: u64 = 32 << 20;

/// Payload bytes per 1500-byte packet at a 1500-byte MTU (ARCHITECTURE.md
/// "Measures"): the rate cap in payload terms is `cap x 1448 / 1500`.
pub const PAYLOAD_PER_PACKET: u64 = 1448;
/// Packet size the payload fraction refers to, bytes.
pub const PACKET_BYTES: u64 = 1500;

/// The payload rate (bit/s) that fills a link capped at `cap_bps`.
pub fn payload_rate(cap_bps: u64) -> u64 {
    (u128::from(cap_bps) * u128::from(PAYLOAD_PER_PACKET) / u128::from(PACKET_BYTES)) as u64
}

/// One transfer's queue.
struct Queue {
    recs: VecDeque<Record>,
    bytes: u64,
    /// Records taken by a writer and not yet written.
    in_write: usize,
    /// Batches (streams) of this transfer open now.
    open: usize,
    /// Batches opened since the transfer became active: the next batch's
    /// sequence number.
    batches: u64,
    /// Batches not yet confirmed by the sink, by sequence number.
    unconfirmed: HashMap<u64, Unconfirmed>,
    /// Sequence numbers of batches given up (their connection was lost
    /// before the sink confirmed them), in the order they were.
    lost: Vec<u64>,
    /// Payload bytes written on each batch not yet confirmed, by sequence
    /// number (progress counts them once the sink confirms).
    batch_bytes: HashMap<u64, u64>,
    /// Sequence numbers of batches the sink confirmed (every batch's
    /// chunks recorded at the sink), on any connection.
    confirmed: HashSet<u64>,
    progress: Arc<LiveProgress>,
}

/// A batch on its way: the connection it went on and the records written
/// on it so far.
struct Unconfirmed {
    writer: WriterId,
    recs: Vec<Record>,
}

impl Queue {
    fn drained(&self) -> bool {
        self.recs.is_empty() && self.in_write == 0 && self.open == 0
    }

    /// Drained, and every batch confirmed or given up.
    fn settled(&self) -> bool {
        let given_up = self
            .lost
            .iter()
            .filter(|l| !self.confirmed.contains(l))
            .count() as u64;
        self.drained() && self.confirmed.len() as u64 + given_up >= self.batches
    }
}

/// The scheduler and the queues of one link, behind one lock.
pub(crate) struct SchedState {
    /// The link's scheduler.
    pub(crate) ls: LinkScheduler,
    queues: HashMap<TransferId, Queue>,
    /// The number of the link's current pool of connections (see
    /// [`LinkSched::new_pool`]); writers of older pools open no batches.
    pool: u64,
    /// Connections of the current pool that were lost, by index.
    lost_connections: HashSet<usize>,
    /// The current pool's connections, by index, for striping.
    conns: Vec<ConnLoad>,
}

/// One connection of a link's pool, as the striping sees it.
#[derive(Debug, Clone, Copy, Default)]
struct ConnLoad {
    /// Payload bytes handed to quinn on it and not yet sent, as modelled:
    /// each connection's congestion controller aims at the link's rate
    /// divided by the pool's connections (`crate::cc`), so the backlog
    /// drains at that rate.
    backlog: f64,
    /// When `backlog` was last brought up to date, Unix ms.
    at_ms: i64,
    /// Its stream writers running.
    writers: usize,
    /// Those of them handing a chunk to quinn now (the others could take
    /// the next chunk at once).
    writing: usize,
}

impl SchedState {
    /// Brings the modelled backlog of every connection up to `now_ms`.
    fn drain(&mut self, now_ms: i64) {
        let per_ms = self.ls.rate_bps() as f64 / 8.0 / 1000.0 / self.conns.len().max(1) as f64;
        for c in &mut self.conns {
            let dt = (now_ms - c.at_ms).max(0) as f64;
            c.backlog = (c.backlog - dt * per_ms).max(0.0);
            c.at_ms = now_ms;
        }
    }

    /// True if writer `me` should leave the next chunk to a writer of
    /// another connection: one of the pool's other live connections has a
    /// writer free and a smaller backlog. Chunks then go to the
    /// connection that will send them soonest (join the shortest queue),
    /// so a transfer's chunks spread evenly over the pool and urgent
    /// chunks do not pile up on one connection while the others send
    /// lower-class bytes at their share of the rate.
    fn defer(&mut self, me: WriterId, now_ms: i64) -> bool {
        if me.pool != self.pool || self.conns.len() < 2 {
            return false;
        }
        self.drain(now_ms);
        let Some(mine) = self.conns.get(me.connection).map(|c| c.backlog) else {
            return false;
        };
        self.conns.iter().enumerate().any(|(i, c)| {
            i != me.connection
                && !self.lost_connections.contains(&i)
                && c.writers > c.writing
                && c.backlog < mine
        })
    }

    /// Writer `me` starts (`+1`) or stops (`-1`) handing a chunk of
    /// `bytes` to quinn (the bytes count once, at the start).
    fn writing(&mut self, me: WriterId, start: bool, bytes: u64) {
        if me.pool != self.pool {
            return;
        }
        if let Some(c) = self.conns.get_mut(me.connection) {
            if start {
                c.writing += 1;
                c.backlog += bytes as f64;
            } else {
                c.writing = c.writing.saturating_sub(1);
            }
        }
    }
}

/// A stream writer's place in its connection's [`ConnLoad`], given up
/// when the writer ends.
struct Seat<'a> {
    sched: &'a LinkSched,
    me: WriterId,
}

impl<'a> Seat<'a> {
    fn take(sched: &'a LinkSched, me: WriterId) -> Seat<'a> {
        let mut s = sched.lock();
        if s.pool == me.pool {
            if let Some(c) = s.conns.get_mut(me.connection) {
                c.writers += 1;
            }
        }
        Seat { sched, me }
    }
}

impl Drop for Seat<'_> {
    fn drop(&mut self) {
        let mut s = self.sched.lock();
        if s.pool == self.me.pool {
            if let Some(c) = s.conns.get_mut(self.me.connection) {
                c.writers = c.writers.saturating_sub(1);
            }
        }
        drop(s);
        // A writer that deferred to this one looks again.
        self.sched.moved.notify_waiters();
    }
}

/// One link's scheduling state, shared by its transfers and writers.
pub(crate) struct LinkSched {
    state: Mutex<SchedState>,
    /// Writers wait here for ready chunks.
    ready: Notify,
    /// Readers wait here for queue space, flushes for their last batch.
    moved: Notify,
    /// Woken when a connection's unconfirmed batches are given up.
    lost: Notify,
    /// The link's metrics (payload bytes by class, chunk retries).
    pub(crate) counters: LinkCounters,
    /// Test hooks (`fault-injection`): a connection to close after its
    /// Nth chunk, and the log of chunks handed to quinn.
    #[cfg(feature = "fault-injection")]
    pub(crate) faults: Mutex<Faults>,
}

/// Which stream writer of a link's pool: the pool's number
/// ([`LinkSched::new_pool`]), connection index (0 is the control
/// connection) and writer index on that connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WriterId {
    pub(crate) pool: u64,
    pub(crate) connection: usize,
    pub(crate) writer: usize,
}

/// Index of the control connection in a link's pool.
const CONTROL: usize = 0;

/// Why a writer could not open a batch.
enum NoBatch {
    /// Its connection was lost, or its pool replaced: the writer stops.
    Lost,
    /// The transfer is no longer active: its record is dropped.
    Inactive,
}

/// One chunk handed to quinn (test hook, `fault-injection`).
#[cfg(feature = "fault-injection")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SentChunk {
    /// Index of the connection in the link's pool (0: the control one).
    pub connection: usize,
    /// Index of the stream writer on that connection.
    pub writer: usize,
    /// The chunk's transfer.
    pub transfer: TransferId,
    /// The class the scheduler served it in.
    pub class: scheduler::Class,
    /// Payload bytes.
    pub bytes: u64,
}

/// Test hooks of a link (`fault-injection`).
#[cfg(feature = "fault-injection")]
#[derive(Debug, Default)]
pub(crate) struct Faults {
    /// Close the pool's connection of this index after it has taken this
    /// many more chunks (once).
    pub(crate) close_after: Option<(usize, u64)>,
    /// Chunks handed to quinn, in the order their writes completed.
    pub(crate) sent: Vec<SentChunk>,
}

/// A connection ended while a transfer was sending.
#[derive(Debug)]
pub(crate) struct Lost(pub String);

impl LinkSched {
    pub(crate) fn new(ls: LinkScheduler, counters: LinkCounters) -> LinkSched {
        LinkSched {
            state: Mutex::new(SchedState {
                ls,
                queues: HashMap::new(),
                pool: 0,
                lost_connections: HashSet::new(),
                conns: Vec::new(),
            }),
            ready: Notify::new(),
            moved: Notify::new(),
            lost: Notify::new(),
            counters,
            #[cfg(feature = "fault-injection")]
            faults: Mutex::new(Faults::default()),
        }
    }

    /// The locked state (a poisoned lock is taken over: the state is
    /// plain data and stays consistent between statements).
    pub(crate) fn lock(&self) -> MutexGuard<'_, SchedState> {
        crate::lock::lock(&self.state)
    }

    /// Wakes the writers (a class, rate or signal changed).
    pub(crate) fn poke(&self) {
        self.ready.notify_waiters();
    }

    /// Makes `t` active with an empty queue reporting to `progress`.
    pub(crate) fn activate(&self, t: scheduler::Transfer, progress: Arc<LiveProgress>) {
        let mut s = self.lock();
        let id = t.id;
        s.ls.upsert(t, now_ms());
        s.queues.insert(
            id,
            Queue {
                recs: VecDeque::new(),
                bytes: 0,
                in_write: 0,
                open: 0,
                batches: 0,
                unconfirmed: HashMap::new(),
                batch_bytes: HashMap::new(),
                confirmed: HashSet::new(),
                lost: Vec::new(),
                progress,
            },
        );
    }

    /// A new pool of `connections` connections starts serving the link:
    /// returns its number, for its writers' [`WriterId`]s. Writers of
    /// older pools can open no more batches.
    pub(crate) fn new_pool(&self, connections: usize) -> u64 {
        let mut s = self.lock();
        s.pool += 1;
        s.lost_connections.clear();
        s.conns = vec![ConnLoad::default(); connections];
        s.pool
    }

    /// The current pool ended (its control connection closed): no
    /// connection of it is open any more.
    pub(crate) fn pool_closed(&self, pool: u64) {
        let mut s = self.lock();
        if s.pool == pool {
            s.conns.clear();
            s.lost_connections.clear();
        }
    }

    /// Connections of the link's current pool open now (0 while none is).
    pub(crate) fn open_connections(&self) -> usize {
        let s = self.lock();
        s.conns.len().saturating_sub(s.lost_connections.len())
    }

    /// Opens a batch of `id` for writer `me`: its sequence number.
    fn open_batch(&self, id: TransferId, me: WriterId) -> Result<u64, NoBatch> {
        let mut s = self.lock();
        if s.pool != me.pool || s.lost_connections.contains(&me.connection) {
            return Err(NoBatch::Lost);
        }
        let q = s.queues.get_mut(&id).ok_or(NoBatch::Inactive)?;
        let seq = q.batches;
        q.batches += 1;
        q.open += 1;
        // The control connection's batches are not kept: losing it
        // replaces the pool, and the resumed run sends what the sink lacks.
        if me.connection != CONTROL {
            q.unconfirmed.insert(
                seq,
                Unconfirmed {
                    writer: me,
                    recs: Vec::new(),
                },
            );
        }
        Ok(seq)
    }

    /// Keeps `rec` with batch `seq` of `id` (writer `me`'s) until the sink
    /// confirms it (not on the control connection, whose loss replaces
    /// the pool). False if the batch's connection was lost meanwhile: the
    /// record is queued again and the writer stops.
    fn track(&self, id: TransferId, seq: u64, me: WriterId, rec: &Record) -> bool {
        if me.connection == CONTROL {
            return true;
        }
        let mut s = self.lock();
        let s = &mut *s;
        let Some(q) = s.queues.get_mut(&id) else {
            // Deactivated: nothing waits for the chunk any more.
            return true;
        };
        match q.unconfirmed.get_mut(&seq) {
            Some(b) if b.writer == me => {
                b.recs.push(rec.clone());
                true
            }
            _ => {
                // Given up already (its connection was lost); a writer of
                // an older pool holds a record of an older run: dropped.
                if s.pool == me.pool {
                    requeue(&mut s.ls, id, q, vec![rec.clone()]);
                }
                false
            }
        }
    }

    /// Queues `rec` of `id` again: writer `me` took it and could not send
    /// it (dropped if `me` belongs to an older pool: the record is of an
    /// older run).
    fn put_back(&self, id: TransferId, me: WriterId, rec: Record) {
        {
            let mut guard = self.lock();
            let s = &mut *guard;
            if s.pool != me.pool {
                return;
            }
            if let Some(q) = s.queues.get_mut(&id) {
                requeue(&mut s.ls, id, q, vec![rec]);
            }
        }
        self.ready.notify_waiters();
    }

    /// Connection `connection` of pool `pool` was lost: every batch sent
    /// on it that the sink has not confirmed is given up, and its records
    /// go back to their transfers' queues, to be sent on the other
    /// connections. Returns the batches given up and the chunks queued
    /// again.
    pub(crate) fn connection_lost(&self, pool: u64, connection: usize) -> (u64, u64) {
        let (mut batches, mut chunks) = (0u64, 0u64);
        {
            let mut s = self.lock();
            if s.pool != pool {
                return (0, 0);
            }
            s.lost_connections.insert(connection);
            let s = &mut *s;
            for (id, q) in s.queues.iter_mut() {
                let mut gone: Vec<u64> = q
                    .unconfirmed
                    .iter()
                    .filter(|(_, b)| b.writer.pool == pool && b.writer.connection == connection)
                    .map(|(seq, _)| *seq)
                    .collect();
                gone.sort_unstable();
                for seq in gone {
                    q.batch_bytes.remove(&seq);
                    if let Some(b) = q.unconfirmed.remove(&seq) {
                        batches += 1;
                        chunks += b.recs.len() as u64;
                        q.lost.push(seq);
                        requeue(&mut s.ls, *id, q, b.recs);
                    }
                }
            }
        }
        self.ready.notify_waiters();
        self.moved.notify_waiters();
        self.lost.notify_waiters();
        (batches, chunks)
    }

    /// The sink confirmed batches `seqs` of `id`: their records are let
    /// go, and their bytes count as verified in its progress.
    pub(crate) fn confirmed(&self, id: TransferId, seqs: &[u64]) {
        let mut s = self.lock();
        if let Some(q) = s.queues.get_mut(&id) {
            let mut bytes = 0;
            for seq in seqs {
                q.unconfirmed.remove(seq);
                q.confirmed.insert(*seq);
                bytes += q.batch_bytes.remove(seq).unwrap_or(0);
            }
            q.progress.verified.fetch_add(bytes, Ordering::Relaxed);
        }
        drop(s);
        self.moved.notify_waiters();
    }

    /// True if `id` is drained ([`LinkSched::drained`]) and the sink
    /// confirmed every batch opened since it became active, except those
    /// given up with a lost connection (their chunks went again in later
    /// batches): every chunk queued so far is recorded at the sink. True
    /// if it is not active.
    pub(crate) fn settled(&self, id: TransferId) -> bool {
        let s = self.lock();
        s.queues.get(&id).is_none_or(Queue::settled)
    }

    /// What a commit of `id` sends now: the batches opened since it became
    /// active (their sequence numbers are `0..batches`) and those given up.
    pub(crate) fn commit_point(&self, id: TransferId) -> (u64, Vec<u64>) {
        self.lock()
            .queues
            .get(&id)
            .map_or((0, Vec::new()), |q| (q.batches, q.lost.clone()))
    }

    /// Starts `id`'s batch numbering again from 0, for a run that opens
    /// the transfer at the sink again on the same connection (the sink
    /// counts a commit's batches from the open). False, and nothing
    /// changed, unless every batch so far is written and confirmed or
    /// given up ([`LinkSched::settled`]); true for a transfer not active
    /// (it has no batches to count).
    pub(crate) fn renumber_batches(&self, id: TransferId) -> bool {
        let mut s = self.lock();
        let Some(q) = s.queues.get_mut(&id) else {
            return true;
        };
        if !q.settled() {
            return false;
        }
        q.batches = 0;
        q.lost.clear();
        q.confirmed.clear();
        q.unconfirmed.clear();
        q.batch_bytes.clear();
        true
    }

    /// Batches of `id` given up so far.
    pub(crate) fn lost_batches(&self, id: TransferId) -> usize {
        self.lock().queues.get(&id).map_or(0, |q| q.lost.len())
    }

    /// True if every chunk `id` queued is written and its batches are
    /// finished (or it is not active).
    pub(crate) fn drained(&self, id: TransferId) -> bool {
        self.lock().queues.get(&id).is_none_or(Queue::drained)
    }

    /// Resolves when a connection's unconfirmed batches are next given up
    /// ([`LinkSched::connection_lost`]); enable it before checking.
    pub(crate) fn losses(&self) -> Notified<'_> {
        self.lost.notified()
    }

    /// Resolves at the next change of the queues (a chunk written, a batch
    /// finished, chunks queued again); enable it before checking a
    /// condition.
    pub(crate) fn changes(&self) -> Notified<'_> {
        self.moved.notified()
    }

    /// Sets the live-progress counters of active transfer `id`.
    pub(crate) fn set_progress(&self, id: TransferId, progress: Arc<LiveProgress>) {
        if let Some(q) = self.lock().queues.get_mut(&id) {
            q.progress = progress;
        }
    }

    /// Ends `id`'s activity: its queue and scheduler entry are dropped.
    pub(crate) fn deactivate(&self, id: TransferId) {
        let mut s = self.lock();
        s.ls.remove(id);
        s.queues.remove(&id);
        drop(s);
        self.moved.notify_waiters();
    }

    /// Queues a ready chunk of `id`, waiting while its queue is full.
    ///
    /// # Errors
    /// [`Lost`] if `conn` closes meanwhile or `id` is not active.
    pub(crate) async fn push(
        &self,
        conn: &Connection,
        id: TransferId,
        rec: Record,
    ) -> Result<(), Lost> {
        let len = rec.data.len() as u64;
        let mut rec = Some(rec);
        loop {
            let moved = self.moved.notified();
            tokio::pin!(moved);
            moved.as_mut().enable();
            {
                let mut s = self.lock();
                let Some(q) = s.queues.get_mut(&id) else {
                    return Err(Lost("the transfer is no longer active".into()));
                };
                if q.recs.is_empty()
                    || (q.recs.len() < QUEUE_RECORDS && q.bytes + len <= QUEUE_BYTES)
                {
                    if let Some(r) = rec.take() {
                        q.recs.push_back(r);
                    }
                    q.bytes += len;
                    s.ls.chunk_ready(id, len);
                    drop(s);
                    self.ready.notify_waiters();
                    return Ok(());
                }
            }
            tokio::select! {
                _ = moved => {}
                e = conn.closed() => return Err(Lost(format!("connection to the sink lost: {e}"))),
            }
        }
    }

    /// Waits until every chunk `id` queued is written and its batches are
    /// finished.
    ///
    /// # Errors
    /// [`Lost`] if `conn` closes first.
    pub(crate) async fn flush(&self, conn: &Connection, id: TransferId) -> Result<(), Lost> {
        loop {
            let moved = self.moved.notified();
            tokio::pin!(moved);
            moved.as_mut().enable();
            if self.lock().queues.get(&id).is_none_or(Queue::drained) {
                return Ok(());
            }
            tokio::select! {
                _ = moved => {}
                e = conn.closed() => return Err(Lost(format!("connection to the sink lost: {e}"))),
            }
        }
    }
}

/// Puts `recs` of `id` back at the end of its queue `q` and tells the
/// scheduler they are ready.
fn requeue(ls: &mut LinkScheduler, id: TransferId, q: &mut Queue, recs: Vec<Record>) {
    for r in recs {
        let len = r.data.len() as u64;
        q.bytes += len;
        ls.chunk_ready(id, len);
        q.recs.push_back(r);
    }
}

enum Step {
    /// Transfer, stream priority, its effective class, chunk.
    Send(TransferId, i32, scheduler::Class, Record),
    Wait(i64),
    Idle,
    /// A writer of another connection takes the next chunk.
    Defer,
}

/// How long a writer that deferred to another connection waits at most
/// before it looks again (it is woken as soon as a chunk is taken or a
/// writer ends).
const DEFER_WAIT: std::time::Duration = std::time::Duration::from_millis(20);

/// Writes the chunks the scheduler picks onto `conn` (writer `me` of the
/// link's pool) until it closes; batches hold about `target` payload
/// bytes.
pub(crate) async fn writer(
    sched: Arc<LinkSched>,
    conn: Connection,
    me: WriterId,
    target: u64,
    stop: tokio_util::sync::CancellationToken,
) {
    let _seat = Seat::take(&sched, me);
    let mut cur: Option<Batch> = None;
    let finish = |cur: &mut Option<Batch>| {
        if let Some(Batch { id, mut s, .. }) = cur.take() {
            let _ = s.finish();
            if let Some(q) = sched.lock().queues.get_mut(&id) {
                q.open = q.open.saturating_sub(1);
            }
            sched.moved.notify_waiters();
        }
    };
    // The open batch ends if nothing more is queued for its transfer (a
    // flush of that transfer waits for its batches to end).
    let finish_if_idle = |cur: &mut Option<Batch>| {
        let idle = cur.as_ref().is_some_and(|c| {
            sched
                .lock()
                .queues
                .get(&c.id)
                .is_none_or(|q| q.recs.is_empty())
        });
        if idle {
            finish(cur);
        }
    };
    loop {
        if stop.is_cancelled() {
            // The agent stops: batches end at a chunk boundary.
            finish(&mut cur);
            return;
        }
        let ready = sched.ready.notified();
        tokio::pin!(ready);
        ready.as_mut().enable();
        let moved = sched.moved.notified();
        tokio::pin!(moved);
        moved.as_mut().enable();
        let step = {
            let mut s = sched.lock();
            let now = now_ms();
            if s.defer(me, now) {
                Step::Defer
            } else {
                match s.ls.next(now) {
                    Decision::Send { id, priority, .. } => {
                        // The class the scheduler served it in (a promotion
                        // shows here, whatever the policy's priorities).
                        let class = s.ls.class_of(id).unwrap_or(scheduler::Class::Scheduled);
                        let rec = s.queues.get_mut(&id).and_then(|q| {
                            let r = q.recs.pop_front()?;
                            q.bytes = q.bytes.saturating_sub(r.data.len() as u64);
                            q.in_write += 1;
                            Some(r)
                        });
                        match rec {
                            Some(r) => {
                                s.writing(me, true, r.data.len() as u64);
                                Step::Send(id, priority, class, r)
                            }
                            // Deactivated between the decision and now.
                            None => continue,
                        }
                    }
                    Decision::Wait { until_ms } => Step::Wait(until_ms),
                    Decision::Idle => Step::Idle,
                }
            }
        };
        if matches!(step, Step::Send(..)) {
            // A queue has room again; writers that deferred look again.
            sched.moved.notify_waiters();
        }
        match step {
            Step::Send(id, priority, class, rec) => {
                if cur.as_ref().is_some_and(|c| c.id != id) {
                    finish(&mut cur);
                }
                let len = rec.data.len() as u64;
                let res = write(&sched, &conn, me, &mut cur, id, priority, rec).await;
                let (progress, empty) = {
                    let mut s = sched.lock();
                    s.writing(me, false, 0);
                    match s.queues.get_mut(&id) {
                        Some(q) => {
                            q.in_write = q.in_write.saturating_sub(1);
                            (Some(q.progress.clone()), q.recs.is_empty())
                        }
                        None => (None, true),
                    }
                };
                match res {
                    Ok(()) => {}
                    Err(WriteFail::Dropped) => {
                        sched.moved.notify_waiters();
                        continue;
                    }
                    Err(WriteFail::Stream(e)) => {
                        // The sink stopped this batch (a refused or
                        // cancelled transfer): drop it; the transfer learns
                        // why on the control stream.
                        tracing::debug!(transfer = %id, "{e}");
                        if let Some(Batch { id: sid, .. }) = cur.take() {
                            if let Some(q) = sched.lock().queues.get_mut(&sid) {
                                q.open = q.open.saturating_sub(1);
                            }
                        }
                        sched.moved.notify_waiters();
                        continue;
                    }
                    Err(WriteFail::Connection(e)) => {
                        // The control connection: every transfer on it
                        // stops (their flushes and pushes see the close).
                        // Another one: its unconfirmed batches go to the
                        // other connections (`LinkSched::connection_lost`).
                        tracing::debug!(transfer = %id, "{e}");
                        finish(&mut cur);
                        conn.close(0u32.into(), b"stream write failed");
                        return;
                    }
                }
                if let Some(p) = progress {
                    p.sent.fetch_add(len, Ordering::Relaxed);
                }

                if let Some(c) = sched.counters.sent.get(class_index(class)) {
                    c.inc_by(len);
                }
                #[cfg(feature = "fault-injection")]
                {
                    let close = {
                        let mut f = crate::lock::lock(&sched.faults);
                        f.sent.push(SentChunk {
                            connection: me.connection,
                            writer: me.writer,
                            transfer: id,
                            class,
                            bytes: len,
                        });
                        match &mut f.close_after {
                            Some((c, n)) if *c == me.connection => {
                                *n = n.saturating_sub(1);
                                let now = *n == 0;
                                if now {
                                    f.close_after = None;
                                }
                                now
                            }
                            _ => false,
                        }
                    };
                    if close {
                        tracing::info!(
                            connection = me.connection,
                            "fault injection: closing a connection of the link"
                        );
                        conn.close(
                            crate::conn::code::PROTOCOL.into(),
                            b"fault injection: connection dropped",
                        );
                    }
                }
                if empty || cur.as_ref().is_some_and(|c| c.bytes >= target) {
                    finish(&mut cur);
                }
                sched.moved.notify_waiters();
            }
            Step::Wait(until_ms) => {
                finish_if_idle(&mut cur);
                let wait = std::time::Duration::from_millis((until_ms - now_ms()).max(1) as u64);
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = ready => {}
                    _ = conn.closed() => { finish(&mut cur); return; }
                    _ = stop.cancelled() => { finish(&mut cur); return; }
                }
            }
            Step::Idle => {
                finish(&mut cur);
                tokio::select! {
                    _ = ready => {}
                    _ = conn.closed() => return,
                    _ = stop.cancelled() => return,
                }
            }
            Step::Defer => {
                finish_if_idle(&mut cur);
                tokio::select! {
                    _ = tokio::time::sleep(DEFER_WAIT) => {}
                    _ = ready => {}
                    _ = moved => {}
                    _ = conn.closed() => { finish(&mut cur); return; }
                    _ = stop.cancelled() => { finish(&mut cur); return; }
                }
            }
        }
    }
}

/// A writer's open batch.
struct Batch {
    id: TransferId,
    s: SendStream,
    /// Payload bytes written on it.
    bytes: u64,
    /// Its sequence number in the transfer's run.
    seq: u64,
}

/// Why a chunk could not be written.
enum WriteFail {
    /// The transfer is no longer active; the chunk was dropped unsent.
    Dropped,
    /// The sink stopped this batch (it refused or dropped the transfer):
    /// the other batches go on.
    Stream(String),
    /// The connection is gone.
    Connection(String),
}

fn classify(e: quinn::WriteError) -> WriteFail {
    match e {
        quinn::WriteError::ConnectionLost(e) => {
            WriteFail::Connection(format!("sending a batch: {e}"))
        }
        other => WriteFail::Stream(format!("sending a batch: {other}")),
    }
}

/// Writes `rec` on writer `me`'s batch of `id`, opening one (with the
/// class's priority) if needed. A record that could not be handed to
/// quinn goes back to its queue, unless the transfer is no longer active.
async fn write(
    sched: &LinkSched,
    conn: &Connection,
    me: WriterId,
    cur: &mut Option<Batch>,
    id: TransferId,
    priority: i32,
    rec: Record,
) -> Result<(), WriteFail> {
    if cur.is_none() {
        let seq = match sched.open_batch(id, me) {
            Ok(seq) => seq,
            Err(NoBatch::Inactive) => return Err(WriteFail::Dropped),
            Err(NoBatch::Lost) => {
                sched.put_back(id, me, rec);
                return Err(WriteFail::Connection("the connection was lost".to_string()));
            }
        };
        // From here the batch counts as opened: if the stream cannot be
        // opened, the connection is gone and the batch is given up with it.
        let s = match conn.open_uni().await {
            Ok(s) => s,
            Err(e) => {
                sched.put_back(id, me, rec);
                if let Some(q) = sched.lock().queues.get_mut(&id) {
                    q.open = q.open.saturating_sub(1);
                }
                return Err(WriteFail::Connection(format!("opening a batch: {e}")));
            }
        };
        let _ = s.set_priority(priority);
        let b = cur.insert(Batch {
            id,
            s,
            bytes: 0,
            seq,
        });
        let header = BatchHeader {
            transfer: id,
            seq: Some(seq),
        };
        if let Err(e) = b.s.write_all(&header.encode()).await {
            sched.put_back(id, me, rec);
            return Err(classify(e));
        }
    }
    if let Some(b) = cur.as_mut() {
        if !sched.track(id, b.seq, me, &rec) {
            return Err(WriteFail::Connection("the connection was lost".to_string()));
        }
        let t0 = std::time::Instant::now();
        let len = rec.data.len();
        // The record's bytes go to quinn as they are; only the header is
        // copied.
        let mut parts = [
            bytes::Bytes::copy_from_slice(&rec.header.encode()),
            rec.data,
        ];
        b.s.write_all_chunks(&mut parts).await.map_err(classify)?;
        b.bytes += len as u64;
        // Counted as verified once the sink confirms the batch (its end
        // comes after this write, so never before).
        if let Some(q) = sched.lock().queues.get_mut(&id) {
            *q.batch_bytes.entry(b.seq).or_default() += len as u64;
        }
        let took = t0.elapsed();
        if took > std::time::Duration::from_millis(20) {
            // The connection's send window or the stream's flow control
            // is full: the link (or the sink) is slower than the rate cap.
            tracing::debug!(
                transfer = %id,
                priority,
                bytes = len,
                ms = took.as_millis() as u64,
                "slow chunk write"
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use ferry_proto::wire::RecordHeader;

    fn sched() -> (LinkSched, TransferId) {
        let ls = LinkScheduler::new(scheduler::Policy::default(), 1_000_000_000, 10, 0);
        let s = LinkSched::new(ls, LinkCounters::default());
        let id = TransferId(7);
        s.activate(
            scheduler::Transfer {
                id,
                class: scheduler::Class::Scheduled,
                job: "j".into(),
                model_params: None,
                importance: 0.0,
                bytes_left: 1 << 20,
                created_ms: 0,
                size_final: true,
                deadline_ms: None,
            },
            Arc::default(),
        );
        (s, id)
    }

    fn rec(chunk: u32) -> Record {
        Record {
            header: RecordHeader {
                file: 0,
                chunk,
                len: 4,
                hash: [0; 32],
            },
            data: bytes::Bytes::from_static(b"abcd"),
        }
    }

    fn queued(s: &LinkSched, id: TransferId) -> Vec<u32> {
        s.lock().queues[&id]
            .recs
            .iter()
            .map(|r| r.header.chunk)
            .collect()
    }

    fn writer(pool: u64, connection: usize) -> WriterId {
        WriterId {
            pool,
            connection,
            writer: 0,
        }
    }

    #[test]
    fn the_next_chunk_goes_to_the_connection_with_the_least_unsent() {
        // 1 Gbit/s over 2 connections: each drains 62.5 bytes per ms.
        let (s, _) = sched();
        let pool = s.new_pool(2);
        let (w0, w1) = (writer(pool, 0), writer(pool, 1));
        let _seats = (Seat::take(&s, w0), Seat::take(&s, w1));
        let mut st = s.lock();
        assert!(!st.defer(w0, 1000), "equal backlogs: whoever asks first");
        assert!(!st.defer(w1, 1000));
        // Connection 0 takes 125,000 bytes at t = 1000 ms.
        st.writing(w0, true, 125_000);
        st.writing(w0, false, 0);
        assert!(st.defer(w0, 1000), "connection 1 has less unsent");
        assert!(!st.defer(w1, 1000));
        // While connection 1's only writer is busy, connection 0 goes on.
        st.writing(w1, true, 1000);
        assert!(!st.defer(w0, 1001));
        st.writing(w1, false, 0);
        assert!(st.defer(w0, 1001));
        // A lost connection is not waited for.
        st.lost_connections.insert(1);
        assert!(!st.defer(w0, 1001));
        st.lost_connections.clear();
        // Both drained after 2 s at 62.5 bytes per ms.
        assert!(!st.defer(w0, 3000));
        // A writer of an older pool never defers.
        assert!(!st.defer(writer(pool - 1, 0), 1000));
        drop(st);
        // A connection whose writers ended is not waited for.
        drop(_seats.1);
        let mut st = s.lock();
        st.writing(w0, true, 125_000);
        st.writing(w0, false, 0);
        assert!(!st.defer(w0, 3000));
    }

    #[test]
    fn progress_counts_a_batch_s_bytes_once_the_sink_confirms_it() {
        let (s, id) = sched();
        let p = Arc::new(LiveProgress::default());
        s.set_progress(id, p.clone());
        {
            let mut l = s.lock();
            let q = l.queues.get_mut(&id).unwrap();
            q.batch_bytes.insert(0, 3_000);
            q.batch_bytes.insert(1, 5_000);
            q.batch_bytes.insert(2, 7_000);
        }
        assert_eq!(p.verified.load(Ordering::Relaxed), 0);
        s.confirmed(id, &[1]);
        assert_eq!(p.verified.load(Ordering::Relaxed), 5_000);
        // Twice, or a batch never written: nothing more.
        s.confirmed(id, &[1, 9]);
        assert_eq!(p.verified.load(Ordering::Relaxed), 5_000);
        s.confirmed(id, &[0, 2]);
        assert_eq!(p.verified.load(Ordering::Relaxed), 15_000);
        assert!(s.lock().queues[&id].batch_bytes.is_empty());
    }

    #[test]
    fn a_lost_connection_s_unconfirmed_batches_are_given_up_and_their_chunks_queued_again() {
        let (s, id) = sched();
        let pool = s.new_pool(4);
        let (w0, w2, w3) = (writer(pool, 0), writer(pool, 2), writer(pool, 3));
        // Batch 0 on connection 2 (chunks 1, 2), batch 1 on the control
        // connection (chunk 3), batch 2 on connection 2 (chunk 4, which the
        // sink confirms), batch 3 on connection 3 (chunk 5).
        let b0 = s.open_batch(id, w2).ok().unwrap();
        assert!(s.track(id, b0, w2, &rec(1)));
        assert!(s.track(id, b0, w2, &rec(2)));
        let b1 = s.open_batch(id, w0).ok().unwrap();
        assert!(s.track(id, b1, w0, &rec(3)));
        let b2 = s.open_batch(id, w2).ok().unwrap();
        assert!(s.track(id, b2, w2, &rec(4)));
        let b3 = s.open_batch(id, w3).ok().unwrap();
        assert!(s.track(id, b3, w3, &rec(5)));
        assert_eq!((b0, b1, b2, b3), (0, 1, 2, 3));
        s.confirmed(id, &[b2]);
        assert_eq!(s.connection_lost(pool, 2), (1, 2));
        assert_eq!(queued(&s, id), [1, 2]);
        assert_eq!(s.commit_point(id), (4, vec![0]));
        assert_eq!(s.lost_batches(id), 1);
        // The scheduler knows the chunks are ready again.
        assert!(matches!(
            s.lock().ls.next(0),
            Decision::Send { id: t, .. } if t == id
        ));
        // A writer of the lost connection still writing batch 0: its
        // record goes back too, and it opens no more batches.
        assert!(!s.track(id, b0, w2, &rec(6)));
        assert_eq!(queued(&s, id), [1, 2, 6]);
        assert!(matches!(s.open_batch(id, w2), Err(NoBatch::Lost)));
        // Connection 3 lives on; its batch stays until confirmed.
        assert_eq!(s.connection_lost(pool, 2), (0, 0), "once");
        assert_eq!(s.commit_point(id), (4, vec![0]));
    }

    #[test]
    fn writers_of_a_replaced_pool_open_nothing_and_requeue_nothing() {
        let (s, id) = sched();
        let old = s.new_pool(4);
        let b = s.open_batch(id, writer(old, 1)).ok().unwrap();
        assert!(s.track(id, b, writer(old, 1), &rec(1)));
        let new = s.new_pool(4);
        assert_ne!(old, new);
        assert_eq!(s.connection_lost(old, 1), (0, 0), "an old pool's loss");
        assert!(matches!(
            s.open_batch(id, writer(old, 2)),
            Err(NoBatch::Lost)
        ));
        s.put_back(id, writer(old, 2), rec(9));
        assert!(queued(&s, id).is_empty(), "an older run's record");
        // The current pool's writers go on.
        assert_eq!(s.open_batch(id, writer(new, 1)).ok(), Some(1));
    }
}
