//! Replays a recorded checkpoint save (`*_save_trace.jsonl`, see
//! `tests/fixtures/README.md`) into a directory: the same creates, writes,
//! renames, fsyncs and closes, in the same order, with the bytes of the
//! real checkpoint files, so the watcher sees what it would see beside the
//! real framework.
#![allow(clippy::unwrap_used, missing_docs, dead_code)]

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// One recorded file-system operation.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Op {
    pub t_ms: f64,
    pub op: String,
    pub path: String,
    #[serde(default)]
    pub to: Option<String>,
    #[serde(default)]
    pub bytes: Option<u64>,
    #[serde(default)]
    pub writes: Option<u64>,
    #[serde(default)]
    pub trunc: Option<bool>,
}

pub struct Replay {
    ops: Vec<Op>,
    next: usize,
    /// Directory holding the final files (the traced root).
    src: PathBuf,
    /// Directory the save is replayed into.
    dst: PathBuf,
    /// Open files: path -> (handle, bytes written so far).
    open: HashMap<String, (File, u64)>,
    /// Where each written path's bytes come from (a temporary is renamed
    /// to its final name later).
    content: HashMap<String, String>,
    /// Milliseconds of wall time per recorded millisecond.
    pub slowdown: f64,
}

impl Replay {
    /// Loads `trace`, keeping only operations on paths under `prefix`
    /// ("" for all).
    pub fn new(trace: &Path, src: &Path, dst: &Path, prefix: &str) -> Replay {
        let ops: Vec<Op> = std::fs::read_to_string(trace)
            .unwrap()
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).unwrap())
            .filter(|o: &Op| o.path.starts_with(prefix))
            .collect();
        // Follow renames so a temporary's bytes come from its final name.
        let mut content = HashMap::new();
        for o in ops.iter().rev() {
            if o.op == "rename" {
                let to = o.to.clone().unwrap();
                let fin = content.get(&to).cloned().unwrap_or(to);
                content.insert(o.path.clone(), fin);
            }
        }
        std::fs::create_dir_all(dst).unwrap();
        Replay {
            ops,
            next: 0,
            src: src.to_path_buf(),
            dst: dst.to_path_buf(),
            open: HashMap::new(),
            content,
            slowdown: 1.0,
        }
    }

    /// The next operation, if any.
    pub fn peek(&self) -> Option<&Op> {
        self.ops.get(self.next)
    }

    /// Applies operations until `stop` holds for the next one (which is
    /// not applied) or the trace ends.
    pub async fn run_until(&mut self, stop: impl Fn(&Op) -> bool) {
        while let Some(op) = self.ops.get(self.next).cloned() {
            if stop(&op) {
                return;
            }
            if self.next > 0 {
                let gap = op.t_ms - self.ops[self.next - 1].t_ms;
                if gap > 0.0 {
                    tokio::time::sleep(Duration::from_secs_f64(
                        (gap * self.slowdown / 1000.0).min(2.0),
                    ))
                    .await;
                }
            }
            self.apply(&op).await;
            self.next += 1;
        }
    }

    /// Applies everything left.
    pub async fn finish(&mut self) {
        self.run_until(|_| false).await;
    }

    async fn apply(&mut self, op: &Op) {
        let p = self.dst.join(&op.path);
        match op.op.as_str() {
            "mkdir" => std::fs::create_dir_all(&p).unwrap(),
            "create" => {
                let f = OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(op.trunc.unwrap_or(false))
                    .open(&p)
                    .unwrap();
                self.open.insert(op.path.clone(), (f, 0));
            }
            "truncate" => {
                let (f, _) = self.open.get_mut(&op.path).unwrap();
                f.set_len(op.bytes.unwrap()).unwrap();
            }
            "write_bytes" => {
                let name = self
                    .content
                    .get(&op.path)
                    .cloned()
                    .unwrap_or_else(|| op.path.clone());
                let bytes = std::fs::read(self.src.join(&name)).unwrap();
                let n = op.bytes.unwrap();
                let pieces = op.writes.unwrap_or(1).clamp(1, 16);
                let (f, off) = self.open.get_mut(&op.path).unwrap();
                let start = *off;
                let step = n.div_ceil(pieces);
                let mut done = 0;
                while done < n {
                    let len = step.min(n - done);
                    let a = (start + done) as usize;
                    use std::os::unix::fs::FileExt;
                    f.write_all_at(&bytes[a..a + len as usize], start + done)
                        .unwrap();
                    done += len;
                    if done < n && self.slowdown > 0.0 {
                        tokio::time::sleep(Duration::from_millis((2.0 * self.slowdown) as u64))
                            .await;
                    }
                }
                *off = start + n;
            }
            "fsync" => {
                if let Some((f, _)) = self.open.get_mut(&op.path) {
                    f.flush().unwrap();
                    f.sync_all().unwrap();
                }
            }
            "close" => {
                self.open.remove(&op.path);
            }
            "rename" => {
                let to = op.to.clone().unwrap();
                std::fs::rename(&p, self.dst.join(&to)).unwrap();
                if let Some(h) = self.open.remove(&op.path) {
                    self.open.insert(to, h);
                }
            }
            "unlink" => {
                let _ = std::fs::remove_file(&p);
            }
            _ => {}
        }
    }
}
