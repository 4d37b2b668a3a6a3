//! The API's JSON types for catalog rows and signal outcomes: converted
//! from the catalog's and the source's types, so the REST schema (this
//! file, served as OpenAPI) and the catalog's tables change apart.

use ferry_proto::state::{CheckpointState, Profile, TransferId, TransferState};
use scheduler::Class;
use serde::Serialize;

/// A transfer at the source, as the API shows it.
#[derive(Debug, Clone, Serialize, PartialEq, utoipa::ToSchema)]
pub struct Transfer {
    /// Transfer id (also sent to the sink).
    #[schema(value_type = i64)]
    pub id: TransferId,
    /// Link name.
    pub link: String,
    /// Job name.
    pub job: String,
    /// Absolute checkpoint path at the source.
    pub source_path: String,
    /// Path relative to the source root.
    pub rel: String,
    /// Scheduler class: the class set by hand or by the config, which a
    /// promoted transfer returns to (see [`Transfer::urgent_until`]).
    pub class: Class,
    /// Transfer state.
    pub state: TransferState,
    /// Bytes in the checkpoint; while it is written (checkpoint `announced`
    /// or `open`), the announced size or the bytes known so far.
    pub bytes_total: i64,
    /// Bytes at the sink as far as the source knows: what the sink had
    /// when the latest run began plus what that run sent (an estimate
    /// until published, when it is `bytes_total`). It never decreases,
    /// also across pause, resume, reconnect and restart.
    pub bytes_done: i64,
    /// Payload bytes put on the wire over all runs (resends included).
    pub bytes_sent: i64,
    /// Number of shards.
    pub shards: i64,
    /// Hex BLAKE3 manifest root once sealed.
    pub manifest_root: Option<String>,
    /// Path of the replica at the sink once published.
    pub local_path: Option<String>,
    /// Last error, if failed.
    pub error: Option<String>,
    /// Creation time (Unix ms).
    pub created_at: i64,
    /// When the transfer first became active (Unix ms).
    pub started_at: Option<i64>,
    /// When it reached a final state (Unix ms).
    pub finished_at: Option<i64>,
    /// The checkpoint's state at the source.
    pub checkpoint: CheckpointState,
    /// Format that recognised the checkpoint, if the watcher found it.
    pub format: Option<String>,
    /// When the checkpoint opened (Unix ms), if known.
    pub opened_at: Option<i64>,
    /// When the checkpoint was committed (Unix ms), if it is.
    pub committed_at: Option<i64>,
    /// Commit identity the watcher saw (marker size and mtime or the
    /// like); a new one in the same directory is a re-save.
    pub commit_identity: Option<String>,
    /// Replication profile: `weights-only`, `weights-first` (every file,
    /// a weights-only version published first), or absent (`null`) for
    /// every file.
    pub profile: Option<Profile>,
    /// Importance override for this transfer, 0..1; `None` = the job's
    /// importance.
    pub importance: Option<f64>,
    /// While now (Unix ms) is before this, the transfer is `urgent`
    /// because a signal promoted it; [`Transfer::class`] is the class it
    /// returns to. `None` = not promoted.
    pub urgent_until: Option<i64>,
    /// Id of the signal that promoted it ([`Signal::id`]), if any.
    pub signal: Option<i64>,
    /// When its replica must be ready, Unix ms, if a client gave a
    /// deadline and its time is known (a deadline after commit gets one
    /// at the commit).
    pub deadline: Option<i64>,
    /// A deadline given as a duration after the commit, seconds.
    pub deadline_after_commit_s: Option<f64>,
    /// What was said about the deadline: `at_risk` (the fluid model's
    /// ready time passed it), `met` or `missed`; `null`: nothing yet.
    #[schema(value_type = Option<String>)]
    pub deadline_state: Option<&'static str>,
    /// Where its time went (ARCHITECTURE.md, "Time to eval-ready"): so
    /// far while it runs, then as recorded when the sink said it
    /// published (its `unattributed_s` is then the finish time minus the
    /// commit time minus the phases after the commit); `null` before its
    /// first run or from an older sink.
    pub phases: Option<PhaseTimes>,
    /// Readers (eval ranks starting at once) its replica should expect,
    /// as the announcement or the push said: an HDFS sink sizes its
    /// hot-file replication hints from it. `null` when not said.
    pub readers: Option<i64>,
}

/// Where a checkpoint's time to eval-ready went: seconds per phase, each
/// measured on one agent's monotonic clock (ARCHITECTURE.md, "Time to
/// eval-ready").
#[derive(Debug, Clone, Serialize, PartialEq, utoipa::ToSchema)]
pub struct PhaseTimes {
    /// Before the commit: `announced` (announced, no file yet), `queued`,
    /// `streaming` (sending ahead of the writer). Seconds.
    pub before_commit: std::collections::BTreeMap<String, f64>,
    /// After the commit: `waiting_for_writer` (the commit marker's mtime
    /// until the watcher saw the checkpoint complete), `queued`,
    /// `sending`, `verifying` (read-back included), `publishing`. Seconds.
    pub after_commit: std::collections::BTreeMap<String, f64>,
    /// Sum of `after_commit`, seconds.
    pub after_commit_s: f64,
    /// The longest phase after the commit.
    pub dominant: Option<String>,
    /// The wall-clock commit-to-publish time minus `after_commit_s`: the
    /// commit message's one-way network delay plus the skew between the
    /// source's and the sink's clocks (near 0 on one host), seconds;
    /// `null` while unknown.
    pub unattributed_s: Option<f64>,
}

impl PhaseTimes {
    /// `p` as the API shows it; `commit_to_ready_s` is the wall-clock
    /// commit-to-publish time, if known.
    pub fn of(p: &ferry_proto::phases::Phases, commit_to_ready_s: Option<f64>) -> PhaseTimes {
        let side =
            |m: &std::collections::BTreeMap<ferry_proto::phases::Phase, std::time::Duration>| {
                m.iter()
                    .map(|(k, d)| (k.as_str().to_string(), round_ms(d.as_secs_f64())))
                    .collect()
            };
        let after = p.after_total().as_secs_f64();
        PhaseTimes {
            before_commit: side(&p.before),
            after_commit: side(&p.after),
            after_commit_s: round_ms(after),
            dominant: p.dominant().map(|(k, _)| k.as_str().to_string()),
            unattributed_s: commit_to_ready_s.map(|t| round_ms(t - after)),
        }
    }
}

/// `x` seconds rounded to the millisecond.
fn round_ms(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

impl From<ferry_catalog::Transfer> for Transfer {
    fn from(r: ferry_catalog::Transfer) -> Self {
        let deadline = r.deadline_ms();
        // A pushed directory is committed when it is pushed.
        let committed = r
            .committed_at
            .or(r.format.is_none().then_some(r.created_at));
        let phases = r.phases.as_ref().map(|p| {
            let done = r
                .finished_at
                .zip(committed)
                .filter(|_| r.state == TransferState::Published)
                .map(|(f, c)| (f - c) as f64 / 1000.0);
            PhaseTimes::of(p, done)
        });
        Transfer {
            id: r.id,
            link: r.link,
            job: r.job,
            source_path: r.source_path,
            rel: r.rel,
            class: r.class,
            state: r.state,
            bytes_total: r.bytes_total,
            bytes_done: r.bytes_done,
            bytes_sent: r.bytes_sent,
            shards: r.shards,
            manifest_root: r.manifest_root,
            local_path: r.local_path,
            error: r.error,
            created_at: r.created_at,
            started_at: r.started_at,
            finished_at: r.finished_at,
            checkpoint: r.checkpoint,
            format: r.format,
            opened_at: r.opened_at,
            committed_at: r.committed_at,
            commit_identity: r.commit_identity,
            profile: (r.profile != Profile::Full).then_some(r.profile),
            importance: r.importance,
            urgent_until: r.urgent_until,
            signal: r.signal,
            deadline,
            deadline_after_commit_s: r.deadline_after_commit.map(|a| a as f64 / 1000.0),
            deadline_state: r.deadline_state.map(|s| s.as_str()),
            phases,
            readers: r.readers,
        }
    }
}

/// An incoming transfer at the sink, or a replica once published, as the API shows it.
#[derive(Debug, Clone, Serialize, PartialEq, utoipa::ToSchema)]
pub struct Replica {
    /// Row id.
    pub id: i64,
    /// Source agent name (certificate SAN).
    pub peer: String,
    /// Source site.
    pub source_site: String,
    /// Transfer id at the source.
    #[schema(value_type = i64)]
    pub source_transfer: TransferId,
    /// Job name.
    pub job: String,
    /// Absolute checkpoint path at the source.
    pub source_path: String,
    /// Path relative to the source root.
    pub rel: String,
    /// Chunk size in bytes.
    pub chunk_size: i64,
    /// State: `receiving`, `published`, `failed`, `cancelled`, once
    /// removed `removing` (out of the published namespace, its files
    /// being deleted) and `removed`; a weights-first transfer's
    /// weights-only version is `queued` until its publish.
    pub state: TransferState,
    /// Bytes in the checkpoint.
    pub bytes_total: i64,
    /// Bytes verified in staging.
    pub bytes_done: i64,
    /// Staging directory.
    pub staging_path: String,
    /// Where the replica is (or will be) published: a local path, or on
    /// an HDFS or S3 sink the path in that store (see `url`).
    pub local_path: String,
    /// On an HDFS or S3 sink, the replica's URL
    /// (`hdfs://eval-nn:8020/eval/site/job/step-100`); absent on a local
    /// one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// On an HDFS sink with hot-file hints: the raised replication of its
    /// hot files while it lasts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hot: Option<replicator::sink::HotView>,
    /// Hex BLAKE3 manifest root once published.
    pub manifest_root: Option<String>,
    /// Last error.
    pub error: Option<String>,
    /// Creation time (Unix ms).
    pub created_at: i64,
    /// Publish time (Unix ms).
    pub published_at: Option<i64>,
    /// When the source committed the checkpoint (Unix ms, source clock).
    pub committed_at: Option<i64>,
    /// Publish time minus the source's commit time, seconds (can be
    /// negative only if the two agents' clocks disagree).
    pub commit_to_replica_s: Option<f64>,
    /// Publish time minus the time the checkpoint opened at the source,
    /// seconds.
    pub open_to_replica_s: Option<f64>,
    /// Replication profile: `weights-only`, or absent (`null`) for every
    /// file.
    pub profile: Option<Profile>,
    /// Training step the source sent with the commit (its checkpoint
    /// format names one); `null` when unknown.
    pub step: Option<i64>,
    /// The transfer's class at commit as the source sent it; `null` from
    /// a source of protocol version 2.
    pub class: Option<Class>,
    /// The operator's pin, if any: the replica never expires, and removing
    /// it needs `force=true`.
    pub pin: Option<ReplicaPin>,
    /// The removal, once `removing` or `removed`.
    pub removal: Option<ReplicaRemoval>,
    /// A `published` row that a newer version at its local path replaced
    /// (a re-save): that row's id. Its files stay in its version
    /// directory only while a reader lease holds it. Absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replaced_by: Option<i64>,
    /// Until when reader leases hold this version (Unix ms; the latest
    /// expiry of its live leases); `null` when none does. A leased
    /// version is never removed (unless by hand with `force=true`).
    pub leased_until: Option<i64>,
    /// The live reader leases on this version (`GET /v1/leases` lists
    /// them all).
    pub leases: Vec<replicator::sink::LeaseGrant>,
    /// Where its time to eval-ready went, once published: the source's
    /// phases until its commit message went and the sink's after it
    /// arrived; `unattributed_s` is `commit_to_replica_s` minus their
    /// sum after the commit. `null` before the publish or from an older
    /// source.
    pub phases: Option<PhaseTimes>,
    /// A weights-first transfer's row: the id of its weights-only
    /// version's row, published first (`queued` until then; `cancelled`
    /// if the full replica came first). Absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weights_version: Option<i64>,
}

/// A pin on a replica.
#[derive(Debug, Clone, Serialize, PartialEq, utoipa::ToSchema)]
pub struct ReplicaPin {
    /// When it was pinned (Unix ms).
    pub at: i64,
    /// Until when (Unix ms); `null` until unpinned.
    pub until: Option<i64>,
    /// Why, as the operator gave it.
    pub reason: String,
}

/// Why a replica was removed.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum RemovalReason {
    /// Its retention policy expired it.
    Rule,
    /// Space pressure.
    Pressure,
    /// An operator removed it.
    Operator,
}

/// The record of a replica's removal.
#[derive(Debug, Clone, Serialize, PartialEq, utoipa::ToSchema)]
pub struct ReplicaRemoval {
    /// `rule`, `pressure` or `operator`.
    pub reason: RemovalReason,
    /// The policy that expired it (and why), or the operator's note.
    pub detail: String,
    /// When it left the published namespace (Unix ms).
    pub started_at: i64,
    /// When its files were gone (Unix ms); `null` while `removing`.
    pub finished_at: Option<i64>,
    /// Bytes it held (its manifest's size), in bytes.
    pub bytes: i64,
    /// An operator removed it past its pin with `force=true`.
    pub forced: bool,
}

impl From<ferry_catalog::Replica> for Replica {
    fn from(r: ferry_catalog::Replica) -> Self {
        Replica {
            id: r.id,
            peer: r.peer,
            source_site: r.source_site,
            source_transfer: r.source_transfer,
            job: r.job,
            source_path: r.source_path,
            rel: r.rel,
            chunk_size: r.chunk_size,
            state: r.state,
            bytes_total: r.bytes_total,
            bytes_done: r.bytes_done,
            staging_path: r.staging_path,
            local_path: r.local_path,
            url: None,
            hot: replicator::sink::HotView::of(r.hot, ferry_catalog::now_ms()),
            manifest_root: r.manifest_root,
            error: r.error,
            created_at: r.created_at,
            published_at: r.published_at,
            committed_at: r.committed_at,
            commit_to_replica_s: r.commit_to_replica_s,
            phases: r
                .phases
                .as_ref()
                .map(|p| PhaseTimes::of(p, r.commit_to_replica_s)),
            open_to_replica_s: r.open_to_replica_s,
            profile: (r.profile != Profile::Full).then_some(r.profile),
            step: r.step,
            class: r.class,
            pin: r.pin.map(|p| ReplicaPin {
                at: p.at,
                until: p.until,
                reason: p.reason,
            }),
            leased_until: r.leased_until.filter(|u| {
                *u > ferry_catalog::now_ms()
                    && r.version_deleted_at.is_none()
                    && r.state == TransferState::Published
            }),
            leases: Vec::new(),
            weights_version: r.weights_version,
            removal: r.removal.map(|m| ReplicaRemoval {
                reason: match m.reason {
                    ferry_catalog::RemovalReason::Rule => RemovalReason::Rule,
                    ferry_catalog::RemovalReason::Pressure => RemovalReason::Pressure,
                    ferry_catalog::RemovalReason::Operator => RemovalReason::Operator,
                },
                detail: m.detail,
                started_at: m.started_at,
                finished_at: m.finished_at,
                bytes: m.bytes,
                forced: m.forced,
            }),
            replaced_by: None,
        }
    }
}

/// A job (training run) as the scheduler ranks it.
#[derive(Debug, Clone, Serialize, PartialEq, utoipa::ToSchema)]
pub struct Job {
    /// Job name.
    pub name: String,
    /// Model size in parameters; `None` = unknown (the size term is 1).
    pub model_params: Option<f64>,
    /// Importance, 0..1.
    pub importance: f64,
    /// Where the values came from: `config` or `api`.
    pub origin: String,
    /// When the row was last written (Unix ms).
    pub updated_at: i64,
}

impl From<ferry_catalog::Job> for Job {
    fn from(r: ferry_catalog::Job) -> Self {
        Job {
            name: r.name,
            model_params: r.model_params,
            importance: r.importance,
            origin: r.origin,
            updated_at: r.updated_at,
        }
    }
}

/// An anomaly report from a training controller.
#[derive(Debug, Clone, Serialize, PartialEq, utoipa::ToSchema)]
pub struct Signal {
    /// Signal id.
    pub id: i64,
    /// Job it is about.
    pub job: String,
    /// What was seen (loss spike, NaN, ...; the API defines the names).
    pub kind: String,
    /// Severity when received, 0..1 (it decays with the configured
    /// half-life).
    pub severity: f64,
    /// Training step the controller reported, if any.
    pub step: Option<i64>,
    /// The client's retry key, if it sent one.
    pub idempotency_key: Option<String>,
    /// The transfer it promoted to `urgent` ([`Transfer::id`]), if any.
    #[schema(value_type = Option<i64>)]
    pub transfer: Option<TransferId>,
    /// When it was received (Unix ms).
    pub received_at: i64,
}

impl From<ferry_catalog::Signal> for Signal {
    fn from(r: ferry_catalog::Signal) -> Self {
        Signal {
            id: r.id,
            job: r.job,
            kind: r.kind,
            severity: r.severity,
            step: r.step,
            idempotency_key: r.idempotency_key,
            transfer: r.transfer,
            received_at: r.received_at,
        }
    }
}

/// What a signal did.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct SignalOutcome {
    /// The stored signal.
    pub signal: Signal,
    /// False if its idempotency key was seen before (nothing changed).
    pub new: bool,
    /// The transfer promoted to `urgent`, if the job had an unpublished
    /// checkpoint.
    #[schema(value_type = Option<i64>)]
    pub promoted: Option<TransferId>,
    /// Until when it stays `urgent`, Unix ms.
    pub urgent_until: Option<i64>,
    /// The promoted transfer's state (a `paused` one stays paused, urgent
    /// once resumed).
    pub promoted_state: Option<TransferState>,
    /// The pins it asked the sinks for, in words; empty when its kind
    /// does not pin (`[source] pin_on`).
    pub pins: Vec<String>,
}

impl From<replicator::source::SignalOutcome> for SignalOutcome {
    fn from(o: replicator::source::SignalOutcome) -> Self {
        SignalOutcome {
            signal: o.signal.into(),
            new: o.new,
            promoted: o.promoted,
            urgent_until: o.urgent_until,
            promoted_state: o.promoted_state,
            pins: o.pins,
        }
    }
}
