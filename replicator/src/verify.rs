//! `ferry verify`: re-hash a published replica against the manifest the
//! sink recorded when it published it.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;

use ferry_catalog::{Catalog, CatalogError};
use ferry_proto::manifest::FileInfo;
use ferry_proto::manifest::{hex, Manifest};

use crate::storage::posix::Posix;
use crate::storage::SourceStore;

/// Outcome of a verification.
#[derive(Debug, Clone)]
pub struct Report {
    /// Files checked.
    pub files: usize,
    /// Bytes read.
    pub bytes: u64,
    /// Hex manifest root.
    pub root: String,
    /// One line per difference (missing file, wrong size, chunk mismatch,
    /// extra file).
    pub problems: Vec<String>,
}

/// Errors before any file is checked.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    /// Catalog trouble.
    #[error(transparent)]
    Catalog(#[from] CatalogError),
    /// The path is not a published replica.
    #[error("{0} is not a published replica in this sink's catalog")]
    NotAReplica(String),
    /// The stored manifest is damaged.
    #[error("stored manifest of {0} cannot be decoded: {1}")]
    BadManifest(String, String),
}

/// Re-hashes every file of the replica at `local_path` (absolute, in a
/// local directory) and compares with the manifest stored in the catalog
/// under `data_dir`.
///
/// # Errors
/// [`VerifyError`] when the replica or its manifest cannot be found;
/// differences are reported in [`Report::problems`], not as errors.
pub async fn verify_replica(data_dir: &Path, local_path: &Path) -> Result<Report, VerifyError> {
    let catalog = Catalog::open_read_only(data_dir).await?;
    verify_replica_in(catalog, Arc::new(Posix), local_path).await
}

/// [`verify_replica`] with the manifest from `catalog` (a PostgreSQL
/// catalog, say), which is closed when the manifest is read, and the
/// files read through `store`: [`Posix`] for a local sink, the sink's
/// HDFS or S3 store for a remote one, where `path` is the replica's path
/// in that store (`/eval/site/job/step_100`, as the catalog's
/// `local_path` holds it).
///
/// # Errors
/// As [`verify_replica`].
pub async fn verify_replica_in(
    catalog: Catalog,
    store: Arc<dyn SourceStore>,
    path: &Path,
) -> Result<Report, VerifyError> {
    let lp = path.to_string_lossy().into_owned();
    let row = match catalog.replica_by_local_path(&lp).await? {
        Some(r) => r,
        // A version directory (`<sink root>/.ferry/versions/<id>`: where
        // a published path's link leads, or a leased path).
        None => match version_id(path) {
            Some(id) => catalog
                .replica(id)
                .await?
                .filter(|r| r.state == ferry_proto::state::TransferState::Published)
                .ok_or_else(|| VerifyError::NotAReplica(lp.clone()))?,
            None => return Err(VerifyError::NotAReplica(lp)),
        },
    };
    let bytes = catalog
        .replica_manifest(row.id)
        .await?
        .ok_or_else(|| VerifyError::NotAReplica(lp.clone()))?;
    catalog.close().await;
    let m = Manifest::decode(&bytes)
        .map_err(|e| VerifyError::BadManifest(lp.clone(), e.to_string()))?;
    let dir = path.to_path_buf();
    let report = tokio::task::spawn_blocking(move || check_in(&*store, &dir, &m))
        .await
        .map_err(|e| VerifyError::BadManifest(lp, e.to_string()))?;
    Ok(report)
}

/// The replica id of a version directory path
/// (`.../.ferry/versions/<id>`).
fn version_id(path: &Path) -> Option<i64> {
    let id = path.file_name()?.to_str()?.parse().ok()?;
    let versions = path.parent()?;
    (versions.file_name()? == "versions" && versions.parent()?.file_name()? == ".ferry")
        .then_some(id)
}

/// Compares the files under the local directory `dir` with `m`.
pub fn check(dir: &Path, m: &Manifest) -> Report {
    check_in(&Posix, dir, m)
}

/// Compares the files under `dir` in `store` with `m`: one listing (sizes,
/// and files the manifest lacks), then every listed file of the manifest
/// read and hashed chunk by chunk. A listing that fails is one problem
/// naming the error.
pub fn check_in(store: &dyn SourceStore, dir: &Path, m: &Manifest) -> Report {
    let mut problems = Vec::new();
    let mut bytes = 0;
    let listed: HashMap<String, FileInfo> = match store.list(dir, &[]) {
        Ok(l) => l
            .files
            .into_iter()
            .map(|f| (f.info.path.clone(), f.info))
            .collect(),
        Err(e) => {
            problems.push(format!("{}: {e}", dir.display()));
            HashMap::new()
        }
    };
    let listing_failed = !problems.is_empty();
    for f in &m.files {
        let Some(info) = listed.get(&f.path) else {
            if !listing_failed {
                problems.push(format!("{}: missing", f.path));
            }
            continue;
        };
        if info.size != f.size {
            problems.push(format!(
                "{}: {} bytes, manifest says {}",
                f.path, info.size, f.size
            ));
            continue;
        }
        let p = dir.join(&f.path);
        match crate::storage::read_chunks(store, &p, info, m.chunk_size, |_, _, _| Ok(())) {
            Ok(hashes) => {
                bytes += f.size;
                for (i, (a, b)) in hashes.iter().zip(&f.chunks).enumerate() {
                    if a != b {
                        problems.push(format!(
                            "{}: chunk {i} hashes to {}, manifest says {}",
                            f.path,
                            hex(a),
                            hex(b)
                        ));
                    }
                }
            }
            Err(e) => problems.push(format!("{}: {e}", f.path)),
        }
    }
    let named: HashSet<&str> = m.files.iter().map(|f| f.path.as_str()).collect();
    let mut extra: Vec<&String> = listed
        .keys()
        .filter(|p| !named.contains(p.as_str()))
        .collect();
    extra.sort();
    problems.extend(extra.iter().map(|p| format!("{p}: not in the manifest")));
    Report {
        files: m.files.len(),
        bytes,
        root: hex(&m.root()),
        problems,
    }
}
