//! The testable parts of the benchmark harness: the byte-for-byte verifier,
//! the measures (one definition each, from ARCHITECTURE.md "Measures"),
//! the kernel counter parser and the result records.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::Serialize;

pub mod servers;

/// Payload bytes per 1500-byte packet the physical limit assumes
/// (1500 - 20 IPv4 - 32 TCP with timestamps; QUIC's overhead is similar).
pub const PAYLOAD_PER_PACKET: f64 = 1448.0;
/// Packet size the physical limit assumes (bytes, the Ethernet MTU).
pub const PACKET: f64 = 1500.0;

/// Physical limit in seconds of copying `bytes` payload bytes over a link
/// of `rate_bps` bit/s and round-trip time `rtt_s` seconds:
/// `bytes x 8 x 1500/1448 / rate + 1.5 RTT`.
pub fn limit_s(bytes: u64, rate_bps: u64, rtt_s: f64) -> f64 {
    bytes as f64 * 8.0 * PACKET / PAYLOAD_PER_PACKET / rate_bps as f64 + 1.5 * rtt_s
}

/// Utilisation: payload bits over (rate x wall seconds), 0..1.
pub fn utilisation(bytes: u64, rate_bps: u64, wall_s: f64) -> f64 {
    bytes as f64 * 8.0 / (rate_bps as f64 * wall_s)
}

/// A file of a tree: its path relative to the tree's root and its size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeFile {
    /// Path relative to the root.
    pub rel: PathBuf,
    /// Size in bytes.
    pub len: u64,
}

/// Every regular file under `root`, sorted by relative path. Symbolic links
/// and other special files are an error (a copy must not contain them).
///
/// # Errors
/// I/O errors naming the path, or a special file.
pub fn list_tree(root: &Path) -> Result<Vec<TreeFile>> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in
            std::fs::read_dir(&dir).with_context(|| format!("listing {}", dir.display()))?
        {
            let entry = entry.with_context(|| format!("listing {}", dir.display()))?;
            let path = entry.path();
            let ft = entry
                .file_type()
                .with_context(|| format!("{}", path.display()))?;
            if ft.is_dir() {
                stack.push(path);
            } else if ft.is_file() {
                let len = entry
                    .metadata()
                    .with_context(|| format!("{}", path.display()))?
                    .len();
                let rel = path.strip_prefix(root).unwrap_or(&path).to_path_buf();
                out.push(TreeFile { rel, len });
            } else {
                bail!("{} is neither a file nor a directory", path.display());
            }
        }
    }
    out.sort_by(|a, b| a.rel.cmp(&b.rel));
    Ok(out)
}

/// What [`compare_trees`] checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Compared {
    /// Files compared.
    pub files: u64,
    /// Bytes compared.
    pub bytes: u64,
}

/// Compares the copy at `copy` with the original at `original` byte for
/// byte. With `only`, just those relative paths (a subset copy); otherwise
/// both trees must hold exactly the same files.
///
/// # Errors
/// The first difference: a missing or extra file, a size or the offset of
/// the first differing byte, naming the file.
pub fn compare_trees(original: &Path, copy: &Path, only: Option<&[PathBuf]>) -> Result<Compared> {
    let files: Vec<PathBuf> = match only {
        Some(list) => list.to_vec(),
        None => {
            let a = list_tree(original)?;
            let b = list_tree(copy)?;
            let names_a: Vec<&PathBuf> = a.iter().map(|f| &f.rel).collect();
            let names_b: Vec<&PathBuf> = b.iter().map(|f| &f.rel).collect();
            if names_a != names_b {
                let missing = names_a.iter().find(|n| !names_b.contains(n));
                let extra = names_b.iter().find(|n| !names_a.contains(n));
                bail!(
                    "file sets differ: {} files in the original, {} in the copy (first missing: {:?}, first extra: {:?})",
                    a.len(),
                    b.len(),
                    missing,
                    extra
                );
            }
            a.into_iter().map(|f| f.rel).collect()
        }
    };
    let mut done = Compared { files: 0, bytes: 0 };
    let mut buf_a = vec![0u8; 1 << 20];
    let mut buf_b = vec![0u8; 1 << 20];
    for rel in &files {
        let (pa, pb) = (original.join(rel), copy.join(rel));
        let mut fa = File::open(&pa).with_context(|| format!("{}", pa.display()))?;
        let mut fb = File::open(&pb).with_context(|| format!("copy of {}", rel.display()))?;
        let (la, lb) = (fa.metadata()?.len(), fb.metadata()?.len());
        if la != lb {
            bail!(
                "{}: {la} bytes in the original, {lb} in the copy",
                rel.display()
            );
        }
        let mut offset = 0u64;
        loop {
            let n = read_full(&mut fa, &mut buf_a).with_context(|| format!("{}", pa.display()))?;
            let m = read_full(&mut fb, &mut buf_b).with_context(|| format!("{}", pb.display()))?;
            if n != m {
                bail!(
                    "{}: changed size while compared, at byte {offset}",
                    rel.display()
                );
            }
            if let Some(i) = buf_a[..n].iter().zip(&buf_b[..n]).position(|(x, y)| x != y) {
                bail!(
                    "{}: first difference at byte {}",
                    rel.display(),
                    offset + i as u64
                );
            }
            if n == 0 {
                break;
            }
            offset += n as u64;
        }
        done.files += 1;
        done.bytes += offset;
    }
    Ok(done)
}

/// Reads until `buf` is full or the end of the file; returns the bytes read.
fn read_full(f: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// Parses `/proc/net/snmp` (pairs of header and value lines per protocol)
/// into `"Proto.Field" -> value`, e.g. `"Udp.RcvbufErrors"`,
/// `"Tcp.RetransSegs"`. Lines that do not pair up are skipped.
pub fn parse_snmp(text: &str) -> BTreeMap<String, i64> {
    let mut out = BTreeMap::new();
    let lines: Vec<&str> = text.lines().collect();
    for pair in lines.chunks(2) {
        let [head, vals] = pair else { continue };
        let (Some((p1, names)), Some((p2, values))) = (head.split_once(':'), vals.split_once(':'))
        else {
            continue;
        };
        if p1 != p2 {
            continue;
        }
        for (n, v) in names.split_whitespace().zip(values.split_whitespace()) {
            if let Ok(v) = v.parse() {
                out.insert(format!("{p1}.{n}"), v);
            }
        }
    }
    out
}

/// The loss counters of one measurement (differences over the run), so a
/// bad figure explains itself.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct LossCounters {
    /// Packets the emulator tail-dropped, source to sink.
    pub emulator_tail_drops_fwd: u64,
    /// Packets the emulator tail-dropped, sink to source.
    pub emulator_tail_drops_rev: u64,
    /// Packets the emulator dropped at random (both directions).
    pub emulator_random_drops: u64,
    /// UDP `RcvbufErrors` in the source namespace.
    pub udp_rcvbuf_errors_src: i64,
    /// UDP `RcvbufErrors` in the sink namespace.
    pub udp_rcvbuf_errors_dst: i64,
    /// TCP `RetransSegs` in the source namespace.
    pub tcp_retrans_src: i64,
    /// TCP `RetransSegs` in the sink namespace.
    pub tcp_retrans_dst: i64,
}

/// One (scenario, tool) result, as written to `results/latest.json`.
#[derive(Debug, Clone, Serialize)]
pub struct Record {
    /// Scenario name (`throughput`, `rtt`, `loss`, ...).
    pub scenario: String,
    /// `ferry`, `rsync`, `rclone`, `per-file`, `quinn` or `iperf3`.
    pub tool: String,
    /// Payload bytes copied (or, when not finished, the checkpoint's size).
    pub bytes: u64,
    /// Files in the copy.
    pub files: u64,
    /// Wall time in seconds.
    pub wall_s: f64,
    /// Payload bit/s over the wall time.
    pub goodput_bps: f64,
    /// Emulated rate cap in bit/s (0 on loopback).
    pub link_rate_bps: u64,
    /// Emulated round-trip time in milliseconds.
    pub rtt_ms: f64,
    /// Random loss per packet and direction.
    pub loss: f64,
    /// Payload bits / (rate x wall), 0..1.
    pub utilisation: f64,
    /// Physical limit in seconds.
    pub limit_s: f64,
    /// Wall time over the physical limit.
    pub wall_over_limit: f64,
    /// Wall time over Ferry's in the same scenario and setting.
    pub ratio_to_ferry: Option<f64>,
    /// Whether every byte the tool copied was compared with the original.
    pub verified: bool,
    /// Whether the copy finished within its time cap.
    pub finished: bool,
    /// Loss counters over the run.
    pub counters: LossCounters,
    /// Scenario-specific numbers (projection, shares, memory, CPU, lag).
    pub extra: serde_json::Value,
}

impl Record {
    /// A record of a copy of `bytes` in `wall_s` over a link of `rate_bps`
    /// and `rtt_ms`, measures derived; `ratio_to_ferry` is filled in later.
    #[allow(clippy::too_many_arguments)]
    pub fn copy(
        scenario: &str,
        tool: &str,
        bytes: u64,
        files: u64,
        wall_s: f64,
        rate_bps: u64,
        rtt_ms: f64,
        loss: f64,
    ) -> Record {
        let limit = if rate_bps > 0 {
            limit_s(bytes, rate_bps, rtt_ms / 1000.0)
        } else {
            0.0
        };
        Record {
            scenario: scenario.into(),
            tool: tool.into(),
            bytes,
            files,
            wall_s,
            goodput_bps: bytes as f64 * 8.0 / wall_s,
            link_rate_bps: rate_bps,
            rtt_ms,
            loss,
            utilisation: if rate_bps > 0 {
                utilisation(bytes, rate_bps, wall_s)
            } else {
                0.0
            },
            limit_s: limit,
            wall_over_limit: if limit > 0.0 { wall_s / limit } else { 0.0 },
            ratio_to_ferry: None,
            verified: false,
            finished: true,
            counters: LossCounters::default(),
            extra: serde_json::json!({}),
        }
    }
}

/// Fills `ratio_to_ferry` of every record from the Ferry record of the same
/// scenario and RTT.
pub fn fill_ratios(records: &mut [Record]) {
    let ferry: Vec<(String, f64, f64)> = records
        .iter()
        .filter(|r| r.tool == "ferry" && r.finished)
        .map(|r| (r.scenario.clone(), r.rtt_ms, r.wall_s))
        .collect();
    for r in records.iter_mut() {
        if let Some((_, _, w)) = ferry
            .iter()
            .find(|(s, rtt, _)| *s == r.scenario && (*rtt - r.rtt_ms).abs() < 1e-9)
        {
            if r.finished && r.scenario != "cpu" {
                r.ratio_to_ferry = Some(r.wall_s / w);
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn tree(root: &Path) {
        std::fs::create_dir_all(root.join("model/layers")).unwrap();
        std::fs::write(root.join("model/a.bin"), vec![7u8; 3 << 20]).unwrap();
        std::fs::write(root.join("model/layers/b.bin"), b"tiny").unwrap();
        std::fs::write(root.join("COMMITTED"), b"").unwrap();
    }

    #[test]
    fn verifier_accepts_an_identical_copy_and_rejects_one_flipped_byte() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        tree(&a);
        tree(&b);
        let ok = compare_trees(&a, &b, None).unwrap();
        assert_eq!(
            ok,
            Compared {
                files: 3,
                bytes: (3 << 20) + 4
            }
        );
        // One byte flipped deep in the large file (past the first block).
        let p = b.join("model/a.bin");
        let mut data = std::fs::read(&p).unwrap();
        data[(2 << 20) + 12_345] ^= 0x01;
        std::fs::write(&p, data).unwrap();
        let err = compare_trees(&a, &b, None).unwrap_err().to_string();
        assert!(
            err.contains("a.bin") && err.contains(&format!("{}", (2 << 20) + 12_345)),
            "{err}"
        );
        // The subset mode checks the files it is given.
        let only = [PathBuf::from("model/layers/b.bin")];
        assert_eq!(compare_trees(&a, &b, Some(&only)).unwrap().files, 1);
        let only = [PathBuf::from("model/a.bin")];
        assert!(compare_trees(&a, &b, Some(&only)).is_err());
    }

    #[test]
    fn verifier_rejects_missing_extra_and_truncated_files() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        tree(&a);
        tree(&b);
        std::fs::remove_file(b.join("COMMITTED")).unwrap();
        let err = compare_trees(&a, &b, None).unwrap_err().to_string();
        assert!(err.contains("COMMITTED"), "{err}");
        std::fs::write(b.join("COMMITTED"), b"").unwrap();
        std::fs::write(b.join("extra"), b"x").unwrap();
        assert!(compare_trees(&a, &b, None)
            .unwrap_err()
            .to_string()
            .contains("extra"));
        std::fs::remove_file(b.join("extra")).unwrap();
        std::fs::write(b.join("model/layers/b.bin"), b"tin").unwrap();
        let err = compare_trees(&a, &b, None).unwrap_err().to_string();
        assert!(
            err.contains("4 bytes in the original, 3 in the copy"),
            "{err}"
        );
    }

    #[test]
    fn measures_follow_their_definitions() {
        // 1.4 GB at 1 Gbit/s, 100 ms: 11.6 s of payload at 1448/1500 plus 0.15 s.
        let l = limit_s(1_400_000_000, 1_000_000_000, 0.1);
        assert!((l - (11.2 * 1500.0 / 1448.0 + 0.15)).abs() < 1e-9, "{l}");
        assert!((utilisation(1_250_000_000, 1_000_000_000, 10.0) - 1.0).abs() < 1e-12);
        let r = Record::copy(
            "throughput",
            "rsync",
            1_400_000_000,
            10,
            14.0,
            1_000_000_000,
            100.0,
            0.0,
        );
        assert!((r.goodput_bps - 8e8).abs() < 1e-3);
        assert!((r.wall_over_limit - 14.0 / l).abs() < 1e-12);
    }

    #[test]
    fn ratios_pair_records_of_the_same_scenario_and_rtt() {
        let mk = |s: &str, t: &str, wall: f64, rtt: f64| {
            Record::copy(s, t, 1_000, 1, wall, 1_000_000, rtt, 0.0)
        };
        let mut rs = vec![
            mk("rtt", "ferry", 10.0, 50.0),
            mk("rtt", "rsync", 15.0, 50.0),
            mk("rtt", "ferry", 20.0, 200.0),
            mk("rtt", "rsync", 60.0, 200.0),
            mk("throughput", "rclone", 40.0, 100.0),
        ];
        fill_ratios(&mut rs);
        assert_eq!(rs[1].ratio_to_ferry, Some(1.5));
        assert_eq!(rs[3].ratio_to_ferry, Some(3.0));
        assert_eq!(rs[0].ratio_to_ferry, Some(1.0));
        assert_eq!(rs[4].ratio_to_ferry, None);
    }

    #[test]
    fn snmp_pairs_headers_with_values() {
        let text = "Ip: Forwarding DefaultTTL\nIp: 1 64\nTcp: RtoAlgorithm RetransSegs\nTcp: 1 42\nUdp: InDatagrams RcvbufErrors\nUdp: 100 7\n";
        let m = parse_snmp(text);
        assert_eq!(m.get("Tcp.RetransSegs"), Some(&42));
        assert_eq!(m.get("Udp.RcvbufErrors"), Some(&7));
        assert_eq!(m.get("Ip.DefaultTTL"), Some(&64));
        assert!(parse_snmp("garbage\n").is_empty());
    }
}
