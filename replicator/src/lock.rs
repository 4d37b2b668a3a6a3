//! One way to take a mutex: a lock poisoned by a panic in another thread
//! is taken anyway, with its data, and the panic is reported, never
//! silently replaced by a fresh lock or skipped.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`. If a thread panicked while holding it, logs that once per
/// call and returns the guard over the data as the panicking thread left
/// it: every user of these locks keeps its data consistent between
/// statements, so what is there is still the best state known.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| {
        tracing::error!(
            "a lock was poisoned by a panic in another task; carrying on with its data"
        );
        m.clear_poison();
        poisoned.into_inner()
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_poisoned_lock_keeps_its_data() {
        let m = std::sync::Arc::new(Mutex::new(vec![1, 2]));
        let m2 = m.clone();
        let _ = std::thread::spawn(move || {
            let mut g = m2.lock().unwrap();
            g.push(3);
            panic!("poison it");
        })
        .join();
        assert!(m.is_poisoned());
        assert_eq!(*lock(&m), [1, 2, 3], "the same data, not a fresh value");
        assert!(!m.is_poisoned(), "reported once, then usable as before");
    }
}
