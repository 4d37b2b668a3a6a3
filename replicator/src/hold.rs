//! Test hooks of the `fault-injection` feature: the next run of a transfer
//! to reach a [`HoldPoint`] (at the source or the sink) stops there until
//! the test lets it go, so a test can land an operator action or a message
//! exactly between two steps instead of hoping a timing loop hits the
//! window. Without the feature a [`Holds`] is empty and holds nothing.

/// Where a transfer can be held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HoldPoint {
    /// Source: the link worker admitted a run; it has not yet marked the
    /// transfer active (nor told the sink anything).
    Begin,
    /// Source: a run sent every chunk the sink lacked and is about to seal
    /// the manifest and send the commit.
    Commit,
    /// Sink: an open arrived on the control stream and is about to be
    /// handled (the control stream waits; data streams go on).
    Open,
    /// Source: a weights-first run sent its weights-only commit and is
    /// about to send the optimizer state.
    WeightsCommitted,
}

#[cfg(feature = "fault-injection")]
pub use armed::{Hold, Holds};

#[cfg(feature = "fault-injection")]
mod armed {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};

    use ferry_proto::state::TransferId;
    use tokio::sync::oneshot;

    use super::HoldPoint;

    /// An armed point: who to tell when a transfer gets there, what it
    /// waits for, and which [`Hold`] armed it.
    struct Armed {
        generation: u64,
        reached: oneshot::Sender<TransferId>,
        release: oneshot::Receiver<()>,
    }

    /// The armed points of one agent.
    #[derive(Default)]
    pub struct Holds {
        armed: Mutex<HashMap<HoldPoint, Armed>>,
        generations: AtomicU64,
    }

    impl Holds {
        /// Arms `point` (replacing an earlier arming of it).
        pub(crate) fn arm(self: &Arc<Self>, point: HoldPoint) -> Hold {
            let generation = self.generations.fetch_add(1, Ordering::Relaxed);
            let (reached_tx, reached_rx) = oneshot::channel();
            let (release_tx, release_rx) = oneshot::channel();
            crate::lock::lock(&self.armed).insert(
                point,
                Armed {
                    generation,
                    reached: reached_tx,
                    release: release_rx,
                },
            );
            Hold {
                holds: self.clone(),
                point,
                generation,
                reached: Some(reached_rx),
                release: Some(release_tx),
            }
        }

        /// Holds transfer `id` at `point` if it is armed (once: the point
        /// is disarmed as it is taken).
        pub(crate) async fn hold(&self, id: TransferId, point: HoldPoint) {
            let armed = crate::lock::lock(&self.armed).remove(&point);
            if let Some(a) = armed {
                tracing::warn!(transfer = %id, ?point, "fault injection: held");
                let _ = a.reached.send(id);
                // Released, or the hold dropped: go on either way.
                let _ = a.release.await;
            }
        }
    }

    /// A test's handle on an armed [`HoldPoint`]. Dropping it disarms the
    /// point and lets a transfer held there go on.
    pub struct Hold {
        holds: Arc<Holds>,
        point: HoldPoint,
        generation: u64,
        reached: Option<oneshot::Receiver<TransferId>>,
        release: Option<oneshot::Sender<()>>,
    }

    impl Hold {
        /// Waits until a transfer reaches the point and returns it; `None`
        /// if none ever will (the point was armed again) or it was already
        /// reported.
        pub async fn reached(&mut self) -> Option<TransferId> {
            self.reached.take()?.await.ok()
        }

        /// Lets the held transfer go on (and disarms the point if none
        /// took it yet).
        pub fn release(mut self) {
            if let Some(r) = self.release.take() {
                let _ = r.send(());
            }
        }
    }

    impl Drop for Hold {
        fn drop(&mut self) {
            let mut m = crate::lock::lock(&self.holds.armed);
            if m.get(&self.point)
                .is_some_and(|a| a.generation == self.generation)
            {
                m.remove(&self.point);
            }
        }
    }
}

/// Without the `fault-injection` feature: nothing is ever armed.
#[cfg(not(feature = "fault-injection"))]
#[derive(Default)]
pub struct Holds;

#[cfg(not(feature = "fault-injection"))]
impl Holds {
    /// Never holds.
    pub(crate) async fn hold(&self, _id: ferry_proto::state::TransferId, _point: HoldPoint) {}
}
