//! The S3 backend of the storage seams (any S3-compatible object store),
//! with the `object_store` client. Paths are key prefixes under the root
//! URL (see [`remote`](super::remote)): `/prefix/step-100` is every key
//! under `prefix/step-100/` of the bucket.
//!
//! - **Listing**: the keys under the prefix, with sizes and last-modified
//!   times (mode 0644: objects have none); the version token is a hash of
//!   the ETag and version id. A path with a commit object (a replica or
//!   version published here) lists as its commit object says, with the
//!   modes and mtimes it records ([`S3::committed`]), and a file of it is
//!   read from the object the commit object names.
//! - **Staging**: objects are immutable and every multipart part but the
//!   last must be at least 5 MiB (10,000 parts at most), while chunks
//!   arrive out of order; each chunk is staged as its own object under
//!   `<staging>/.ferry-chunks/`. A publish writes each file once: files up
//!   to [`PART_TARGET`] in one PUT, larger ones as a multipart upload whose
//!   parts are k whole consecutive chunks, k = ceil(8 MiB / chunk size),
//!   raised so that no file needs more than 10,000 parts.
//! - **Publish**: every version has a prefix of its own, the version
//!   directory the sink names (`<root>/.ferry/versions/<id>`). Its files
//!   are written there, markers last, then its commit object
//!   `<version>.ferry-commit` (JSON: the manifest root; every file's path,
//!   size, mode and mtime; the version's key prefix; the keys of files kept
//!   from an earlier version) by a conditional create (`If-None-Match:
//!   *`), so that of two publishers of a version exactly one wins. Last,
//!   the published path's commit object `<path>.ferry-commit` is written
//!   with the same content, by one PUT (a conditional create for the
//!   first version at a path): a reader sees the older commit object or
//!   the new one, each naming a whole version, never a mixture. A reader
//!   takes a replica to exist only while its commit object does, and
//!   reads file `f` at the key the commit object gives (`kept[f]`, else
//!   `<version>/f`). An older version stays readable at its own prefix
//!   (a reader lease's URL) until the sink withdraws it.
//!   `<staging>/.ferry-publishing` says a publish is under way.
//! - **Sharing an unchanged file** of a re-save: no copy. Staging records
//!   the published object's key, ETag and size
//!   (`<staging>/.ferry-shared/<rel>`), and the new version's commit
//!   object names that object, once the publish has checked that it is
//!   still what was shared (else, with the read-back, the file's chunks
//!   are fetched again). An object may be up to 5 TB, and S3 copies at
//!   most 5 GB in one request.
//! - **Removal** ([`SinkStore::withdraw`]): the published path's commit
//!   object first when it names the version, then the version's objects
//!   and the kept objects it names, but for those a version that stays
//!   names (the caller lists them) or owns, then the version's commit
//!   object.
//! - **Replicas of an earlier release** (a commit object without a
//!   version, the files under the published path): read as before; the
//!   next version at the path deletes their objects but for those it
//!   keeps.
//! - **Free space**: a configured capacity less what the root holds;
//!   `None` without one.
//!
//! Credentials come from [`S3Config`] or the standard `AWS_*` environment
//! variables; they never appear in `Debug` output or errors.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use ferry_proto::manifest::{chunk_count, chunk_len, FileInfo, Hash, Manifest};
use futures::{StreamExt, TryStreamExt};
use object_store::aws::{AmazonS3, AmazonS3Builder, S3ConditionalPut};
use object_store::path::Path as Key;
use object_store::{
    BackoffConfig, ClientOptions, MultipartUpload, ObjectStore, PutMode, PutOptions, PutPayload,
    RetryConfig,
};
use serde::{Deserialize, Serialize};

use super::posix::publish::fault_point;
use super::remote::{self, block_on, chunk_key, RemoteRoot};
use super::{
    FileVersion, Listed, Listing, PublishOutcome, RangeRead, ReadBack, ScanError, SinkStore,
    SourceStore, Staging, Watch, WatchHandler,
};

/// Size (bytes) a multipart part aims at, and the largest file sent in
/// one PUT: 8 MiB.
pub const PART_TARGET: u64 = 8 << 20;
/// S3's smallest part but the last (bytes), AWS S3 documentation,
/// "Amazon S3 multipart upload limits".
pub const MIN_PART: u64 = 5 << 20;
/// S3's most parts in one upload (same source).
pub const MAX_PARTS: u64 = 10_000;

/// How to reach an S3-compatible store; fields left `None` come from the
/// `AWS_*` environment variables (`AWS_ENDPOINT`, `AWS_REGION`,
/// `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`).
#[derive(Clone, Default)]
pub struct S3Config {
    /// Endpoint URL (`http://127.0.0.1:8333`); `None` for AWS itself.
    pub endpoint: Option<String>,
    /// Region (`us-east-1` when neither this nor the environment says).
    pub region: Option<String>,
    /// Access key id.
    pub access_key_id: Option<String>,
    /// Secret access key.
    pub secret_access_key: Option<String>,
    /// Bytes a sink may fill under the root; `None`: unknown.
    pub capacity: Option<u64>,
}

impl fmt::Debug for S3Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Config")
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .field("credentials", &"<redacted>")
            .field("capacity", &self.capacity)
            .finish()
    }
}

/// A bucket of an S3-compatible store, opened at one root URL.
#[derive(Clone)]
pub struct S3 {
    root: RemoteRoot,
    store: Arc<AmazonS3>,
    capacity: Option<u64>,
    parts: Arc<Mutex<Vec<Vec<u64>>>>,
    publish_threads: usize,
    /// Commit objects read by the latest listings of published replicas
    /// (path to commit), so that the reads of a listing's files find
    /// the objects of the version listed, even if a publish replaces it
    /// meanwhile. At most [`COMMITS_CACHED`].
    commits: Arc<Mutex<HashMap<String, Arc<Commit>>>>,
    /// The commit objects a re-save's shared files were looked up in
    /// (path to ETag and commit), read again only when the ETag moves: a
    /// checkpoint shares thousands of files with one published version.
    shared_from: Arc<Mutex<HashMap<String, TaggedCommit>>>,
}

/// A commit object with the ETag it was read at.
type TaggedCommit = (Option<String>, Arc<Commit>);

/// The object found for a path ([`S3::locate`]).
struct Located {
    meta: object_store::ObjectMeta,
    /// The file's mtime (ns since the epoch) as its commit object records
    /// it, where the path was found through one; else the object's own.
    mtime_ns: Option<i64>,
}

impl Located {
    /// Size (bytes), mtime (ns since the epoch) and version token.
    fn stat(&self) -> (u64, i64, FileVersion) {
        let m = &self.meta;
        (
            m.size,
            self.mtime_ns
                .unwrap_or_else(|| m.last_modified.timestamp_nanos_opt().unwrap_or(0)),
            version_of(m),
        )
    }
}

/// Commit objects an [`S3`] store keeps from its listings.
const COMMITS_CACHED: usize = 64;

impl fmt::Debug for S3 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "S3({})", self.root.url)
    }
}

/// An `object_store` error as an I/O error of the same kind.
fn io_of(e: object_store::Error) -> io::Error {
    use object_store::Error as E;
    let kind = match &e {
        E::NotFound { .. } => io::ErrorKind::NotFound,
        E::AlreadyExists { .. } | E::Precondition { .. } => io::ErrorKind::AlreadyExists,
        E::PermissionDenied { .. } | E::Unauthenticated { .. } => io::ErrorKind::PermissionDenied,
        _ => io::ErrorKind::Other,
    };
    let msg = without_xml(&e.to_string());
    if msg.contains(METADATA_SERVICE) {
        // No keys were given, so the client asked the instance metadata
        // service for some (there is one only on a cloud VM).
        return io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "no S3 credentials: set access_key_id and secret_access_key_file in [source.s3] or \
                 [sink.s3] (or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY); without them the \
                 client asked the instance metadata service at {METADATA_SERVICE}, which answered: {msg}"
            ),
        );
    }
    io::Error::new(kind, msg)
}

/// Where an S3 client without keys asks for them (the EC2 instance
/// metadata service, AWS documentation "Use the Instance Metadata Service
/// to access instance metadata").
const METADATA_SERVICE: &str = "169.254.169.254";

/// `msg` with an S3 error document in it (`<?xml ...><Error><Code>..`)
/// cut down to its code and message (`SignatureDoesNotMatch: The request
/// signature we calculated does not match ...`): the rest (request id,
/// host id, resource) only lengthens the logs. A message without one is
/// returned as it is.
fn without_xml(msg: &str) -> String {
    let Some(start) = msg.find("<?xml").or_else(|| msg.find("<Error>")) else {
        return msg.to_string();
    };
    let field = |name: &str| {
        let open = format!("<{name}>");
        let from = msg[start..].find(&open)? + start + open.len();
        let to = msg[from..].find(&format!("</{name}>"))? + from;
        Some(msg[from..to].trim().to_string())
    };
    let said = match (field("Code"), field("Message")) {
        (Some(c), Some(m)) => format!("{c}: {m}"),
        (Some(c), None) => c,
        (None, Some(m)) => m,
        (None, None) => "an error document without a code".to_string(),
    };
    // What object_store wrote after the document (a retry count, say).
    let tail = msg[start..]
        .rfind('>')
        .map_or("", |i| msg[start + i + 1..].trim());
    let head = msg[..start].trim_end();
    let mut out = format!("{head} {said}");
    if !tail.is_empty() {
        out = format!("{out} {tail}");
    }
    out
}

fn version_of(m: &object_store::ObjectMeta) -> FileVersion {
    let h = |s: &Option<String>| {
        s.as_deref()
            .map_or(0, |s| xxhash_rust::xxh3::xxh3_64(s.as_bytes()))
    };
    FileVersion([h(&m.e_tag), h(&m.version), m.size, 0])
}

/// The commit object of a published replica (`<path>.ferry-commit`, JSON)
/// and of each version (`<version>.ferry-commit`).
#[derive(Debug, Serialize, Deserialize)]
struct Commit {
    /// The manifest root, hex.
    root: String,
    /// Every file: path, size (bytes), mode, mtime (ns since the epoch).
    files: Vec<(String, u64, u32, i64)>,
    /// The key prefix of the version whose objects are the files
    /// (`eval/.ferry/versions/12`: file `w.bin` is the object
    /// `eval/.ferry/versions/12/w.bin`); absent for a replica published
    /// before versioned prefixes, whose files are under the published
    /// path itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    version: Option<String>,
    /// Files kept from an earlier version (unchanged by a re-save): path
    /// to the key of that version's object, which stays while a version
    /// names it.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    kept: BTreeMap<String, String>,
}

impl Commit {
    /// The key of file `rel` of the replica published at `at` (a path
    /// under the root) with this commit object.
    fn object(&self, at: &str, rel: &str) -> String {
        match (self.kept.get(rel), &self.version) {
            (Some(k), _) => k.clone(),
            (None, Some(v)) => format!("{v}/{rel}"),
            (None, None) => format!("{}/{rel}", at.trim_start_matches('/')),
        }
    }
}

/// What `<staging>/.ferry-shared/<rel>` holds: the published object an
/// unchanged file of a re-save keeps, as it was when it was shared.
#[derive(Debug, Serialize, Deserialize)]
struct SharedRef {
    /// The object's key.
    key: String,
    /// Its ETag and size then; the publish keeps it only if both hold.
    e_tag: Option<String>,
    size: u64,
}

fn hex(h: &Hash) -> String {
    h.iter().map(|b| format!("{b:02x}")).collect()
}

impl S3 {
    /// Opens `url` (`s3://bucket/prefix`) and checks that the endpoint
    /// answers, the credentials are accepted and the bucket exists, with a
    /// listing of the root.
    ///
    /// # Errors
    /// `InvalidInput` for a URL that is not `s3://`; the server's error
    /// (unreachable endpoint, refused credentials, missing bucket), each
    /// naming the root URL.
    pub fn connect(url: &str, cfg: &S3Config) -> io::Result<S3> {
        let root = RemoteRoot::parse(url)?;
        if root.scheme != "s3" {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("storage root {url}: not an s3:// URL"),
            ));
        }
        let mut b = AmazonS3Builder::from_env()
            .with_bucket_name(&root.authority)
            .with_conditional_put(S3ConditionalPut::ETagMatch)
            .with_retry(RetryConfig {
                backoff: BackoffConfig::default(),
                max_retries: 3,
                retry_timeout: Duration::from_secs(20),
            })
            .with_client_options(
                ClientOptions::new()
                    .with_connect_timeout(Duration::from_secs(10))
                    .with_timeout(Duration::from_secs(100))
                    .with_allow_http(true),
            );
        if let Some(e) = &cfg.endpoint {
            b = b
                .with_endpoint(e)
                .with_virtual_hosted_style_request(false)
                .with_allow_http(e.starts_with("http://"));
        }
        let region = cfg
            .region
            .clone()
            .or_else(|| std::env::var("AWS_REGION").ok())
            .unwrap_or_else(|| "us-east-1".into());
        let env_endpoint = ["AWS_ENDPOINT_URL", "AWS_ENDPOINT"]
            .iter()
            .find_map(|v| std::env::var(v).ok());
        match (&cfg.endpoint, env_endpoint) {
            (Some(e), _) => tracing::info!(root = %url, endpoint = %e, %region, "S3 store"),
            (None, Some(e)) => {
                tracing::info!(root = %url, endpoint = %e, %region, "S3 store (endpoint from the environment)")
            }
            (None, None) => tracing::info!(
                root = %url,
                %region,
                "S3 store: no endpoint configured, so AWS S3 itself (an endpoint key in the \
                 config, or AWS_ENDPOINT, names another)"
            ),
        }
        b = b.with_region(region);
        if let Some(k) = &cfg.access_key_id {
            b = b.with_access_key_id(k);
        }
        if let Some(s) = &cfg.secret_access_key {
            b = b.with_secret_access_key(s);
        }
        let store = b
            .build()
            .map_err(|e| io::Error::other(format!("storage root {url}: {e}")))?;
        let s = S3 {
            root,
            store: Arc::new(store),
            capacity: cfg.capacity,
            parts: Arc::default(),
            publish_threads: remote::PUBLISH_THREADS,
            commits: Arc::default(),
            shared_from: Arc::default(),
        };
        let prefix = s.key_of_str(&s.root.path.to_string_lossy());
        s.call(
            "list",
            s.root.path.to_string_lossy().into_owned(),
            move |st| async move { st.list_with_delimiter(Some(&prefix)).await.map(|_| ()) },
        )?;
        Ok(s)
    }

    /// The root this store was opened at.
    pub fn root(&self) -> &RemoteRoot {
        &self.root
    }

    /// Files a publish reads back and writes at once (at least 1;
    /// default [`remote::PUBLISH_THREADS`]): for the benchmark, which
    /// compares it with one at a time.
    pub fn with_publish_threads(mut self, n: usize) -> S3 {
        self.publish_threads = n.max(1);
        self
    }

    /// The part sizes (bytes) of every multipart upload this store has
    /// completed, in order: for the conformance suite, which refuses any
    /// part but the last under [`MIN_PART`].
    pub fn multipart_parts(&self) -> Vec<Vec<u64>> {
        self.parts.lock().map(|p| p.clone()).unwrap_or_default()
    }

    /// The key of store path `p` (`/prefix/x` → `prefix/x`).
    fn key_of_str(&self, p: &str) -> Key {
        Key::from(p.trim_start_matches('/'))
    }

    fn key(&self, p: &Path) -> io::Result<Key> {
        Ok(self.key_of_str(&self.root.check(p)?))
    }

    fn call<T: Send + 'static, F>(
        &self,
        what: &str,
        path: String,
        f: impl FnOnce(Arc<AmazonS3>) -> F,
    ) -> io::Result<T>
    where
        F: std::future::Future<Output = object_store::Result<T>> + Send + 'static,
    {
        let fut = f(self.store.clone());
        block_on(&format!("{} {what} {path}", self.root.url), async move {
            fut.await.map_err(io_of)
        })
    }

    fn put(&self, key: Key, data: Bytes) -> io::Result<()> {
        self.call("put", key.to_string(), move |st| async move {
            st.put(&key, PutPayload::from(data)).await.map(|_| ())
        })
    }

    fn get(&self, key: Key) -> io::Result<Bytes> {
        self.call("get", key.to_string(), move |st| async move {
            st.get(&key).await?.bytes().await
        })
    }

    fn head(&self, key: Key) -> io::Result<Option<object_store::ObjectMeta>> {
        match self.call("head", key.to_string(), move |st| async move {
            st.head(&key).await
        }) {
            Ok(m) => Ok(Some(m)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn list_keys(&self, prefix: Key) -> io::Result<Vec<object_store::ObjectMeta>> {
        self.call("list", prefix.to_string(), move |st| async move {
            st.list(Some(&prefix)).try_collect::<Vec<_>>().await
        })
    }

    /// Deletes every object under `prefix`, in bulk deletions (S3's
    /// DeleteObjects, up to 1,000 keys a request); `Ok(n)`, how many there
    /// were.
    fn delete_prefix(&self, prefix: Key) -> io::Result<usize> {
        let keys: Vec<Key> = self
            .list_keys(prefix.clone())?
            .into_iter()
            .map(|m| m.location)
            .collect();
        let n = keys.len();
        self.delete_keys(prefix.to_string(), keys)?;
        Ok(n)
    }

    /// Where staging `s` records file `rel` as shared ([`SharedRef`]).
    fn shared_key(&self, s: &str, rel: &str) -> Key {
        self.key_of_str(&format!("{s}/.ferry-shared/{rel}"))
    }

    /// The shared object recorded for file `f` of staging `s`, `None` when
    /// the file was staged; `Some(false)` when the object no longer is
    /// what was shared (gone, or another ETag or size).
    fn shared_holds(
        &self,
        s: &str,
        f: &ferry_proto::manifest::FileEntry,
    ) -> io::Result<Option<(Key, bool)>> {
        let r = match self.get(self.shared_key(s, &f.path)) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let r: SharedRef = serde_json::from_slice(&r).map_err(|e| {
            io::Error::other(format!(
                "{}{s}/.ferry-shared/{}: not a shared-file record: {e}",
                self.root.url, f.path
            ))
        })?;
        let key = Key::from(r.key);
        let holds = self
            .head(key.clone())?
            .is_some_and(|m| m.e_tag == r.e_tag && m.size == r.size && m.size == f.size);
        Ok(Some((key, holds)))
    }

    /// The error of a publish that finds the object `kept`, shared with
    /// the version it publishes, changed or gone.
    fn changed_since_shared(&self, kept: &Key) -> io::Error {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{}{kept}: the published object shared with this version changed or is gone \
                 since; the file must be sent again",
                self.root.url
            ),
        )
    }

    fn commit_key(&self, l: &str) -> Key {
        self.key_of_str(&format!("{l}.ferry-commit"))
    }

    /// The object that is file `path` of a published replica or version,
    /// through the commit object of the nearest directory above it that
    /// has one, else the object at `path` itself; `None` when neither
    /// names one that exists. With `cached` (a reader's open after a
    /// listing), a commit object of the latest listings comes first (see
    /// [`S3::commits`]), so that the reads of a listing's files see the
    /// version it listed.
    fn locate(&self, path: &Path, cached: bool) -> io::Result<Option<Located>> {
        let p = self.root.check(path)?;
        let in_commit = |a: &str, c: &Commit| {
            let rel = p[a.len()..].trim_start_matches('/');
            c.files
                .iter()
                .find(|f| f.0 == rel)
                .map(|f| (Key::from(c.object(a, rel)), f.3))
        };
        let head = |(k, mtime): (Key, i64)| -> io::Result<Option<Located>> {
            Ok(self.head(k)?.map(|meta| Located {
                meta,
                mtime_ns: Some(mtime),
            }))
        };
        let listed = cached.then(|| {
            let cache = self.commits.lock().unwrap_or_else(|e| e.into_inner());
            Path::new(&p).ancestors().skip(1).find_map(|a| {
                let a = a.to_string_lossy();
                cache.get(a.as_ref()).and_then(|c| in_commit(&a, c))
            })
        });
        if let Some(k) = listed.flatten() {
            // (Gone since: a withdrawn version; look again below.)
            if let Some(l) = head(k)? {
                return Ok(Some(l));
            }
        }
        if let Some(meta) = self.head(self.key_of_str(&p))? {
            return Ok(Some(Located {
                meta,
                mtime_ns: None,
            }));
        }
        for a in Path::new(&p).ancestors().skip(1) {
            if !a.starts_with(&self.root.path) {
                break;
            }
            let a = a.to_string_lossy();
            if let Some(c) = self.read_commit(&a)? {
                return match in_commit(&a, &c) {
                    Some(k) => head(k),
                    None => Ok(None),
                };
            }
        }
        Ok(None)
    }

    /// The commit object of the replica published at `p`, read once per
    /// ETag of it ([`S3::shared_from`]); `None` when there is none.
    fn published_commit(&self, p: &str) -> io::Result<Option<Arc<Commit>>> {
        let Some(meta) = self.head(self.commit_key(p))? else {
            return Ok(None);
        };
        {
            let cache = self.shared_from.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((tag, c)) = cache.get(p) {
                if tag.is_some() && *tag == meta.e_tag {
                    return Ok(Some(c.clone()));
                }
            }
        }
        let Some(c) = self.read_commit(p)? else {
            return Ok(None);
        };
        let c = Arc::new(c);
        let mut cache = self.shared_from.lock().unwrap_or_else(|e| e.into_inner());
        if cache.len() >= COMMITS_CACHED {
            cache.clear();
        }
        cache.insert(p.to_string(), (meta.e_tag, c.clone()));
        Ok(Some(c))
    }

    /// Deletes the objects under published path `l` (a replica of an
    /// earlier release left them there; versions never write there) but
    /// for those `c`, the commit object now published at `l`, keeps.
    fn delete_unkept_under(&self, l: &str, c: &Commit) -> io::Result<()> {
        let keep: HashSet<&String> = c.kept.values().collect();
        let gone: Vec<Key> = self
            .list_keys(self.key_of_str(l))?
            .into_iter()
            .map(|m| m.location)
            .filter(|k| !keep.contains(&k.to_string()))
            .collect();
        self.delete_keys(self.root.url_of(Path::new(l)), gone)
    }

    /// Remembers the commit object read for the replica at `at`.
    fn cache_commit(&self, at: &str, c: Arc<Commit>) {
        let mut cache = self.commits.lock().unwrap_or_else(|e| e.into_inner());
        if cache.len() >= COMMITS_CACHED && !cache.contains_key(at) {
            cache.clear();
        }
        cache.insert(at.to_string(), c);
    }

    /// Deletes the objects `keys`, in bulk deletions (S3's DeleteObjects,
    /// up to 1,000 keys a request); an object gone already is no error.
    fn delete_keys(&self, what: String, keys: Vec<Key>) -> io::Result<()> {
        if keys.is_empty() {
            return Ok(());
        }
        self.call("delete", what, move |st| async move {
            let located = futures::stream::iter(keys.into_iter().map(Ok)).boxed();
            let mut results = st.delete_stream(located);
            while let Some(r) = results.next().await {
                match r {
                    Ok(_) | Err(object_store::Error::NotFound { .. }) => {}
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        })
    }

    fn read_commit(&self, l: &str) -> io::Result<Option<Commit>> {
        let bad = |why: String| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{}{l}.ferry-commit: {why}", self.root.url),
            )
        };
        match self.get(self.commit_key(l)) {
            Ok(b) => {
                let c: Commit = serde_json::from_slice(&b)
                    .map_err(|e| bad(format!("not a commit object: {e}")))?;
                // Its keys are read, kept and deleted: only keys under the
                // root, so that an object changed by hand cannot send a
                // deletion anywhere else.
                let under = |k: &str| {
                    self.root
                        .check(Path::new(&format!("/{k}")))
                        .is_ok_and(|p| Path::new(&p) != self.root.path)
                };
                if let Some(k) = c.version.iter().chain(c.kept.values()).find(|k| !under(k)) {
                    return Err(bad(format!("names key {k:?}, outside the root")));
                }
                Ok(Some(c))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The files of the replica published at `path` as its commit object
    /// records them (path, size, mode, mtime), or `None` when no replica
    /// is published there.
    ///
    /// # Errors
    /// The server's error, or a commit object that does not parse.
    pub fn committed(&self, path: &Path) -> io::Result<Option<Vec<FileInfo>>> {
        let l = self.root.check(path)?;
        Ok(self.read_commit(&l)?.map(|c| {
            c.files
                .into_iter()
                .map(|(path, size, mode, mtime_ns)| FileInfo {
                    path,
                    size,
                    mode,
                    mtime_ns,
                })
                .collect()
        }))
    }

    /// Writes `data` as the object at `path` (under the root), replacing
    /// any object there: for tests and the generator.
    ///
    /// # Errors
    /// The server's error, naming the key and root.
    pub fn put_file(&self, path: &Path, data: &[u8]) -> io::Result<()> {
        self.put(self.key(path)?, Bytes::copy_from_slice(data))
    }

    /// Starts the object at `path` (under the root), `size` bytes long
    /// when complete, for writing in order: for the generator. Up to
    /// [`PART_TARGET`] bytes go out in one PUT at [`S3Writer::close`];
    /// a larger object is a multipart upload of equal parts of
    /// [`PART_TARGET`] bytes (more where the object would need more than
    /// [`MAX_PARTS`]), each sent once it is full, so memory stays at one
    /// part. Nothing is visible at `path` before `close` returns; an object
    /// there is replaced then.
    ///
    /// # Errors
    /// `InvalidInput` for a path outside the root, naming it and the root.
    pub fn create_file(&self, path: &Path, size: u64) -> io::Result<S3Writer> {
        let key = self.key(path)?;
        let part = PART_TARGET.max(size.div_ceil(MAX_PARTS));
        Ok(S3Writer {
            store: self.clone(),
            key,
            part: usize::try_from(part).map_err(|_| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{}: {size} bytes is too large", self.root.url_of(path)),
                )
            })?,
            buf: Vec::new(),
            upload: None,
            sizes: Vec::new(),
        })
    }

    /// Deletes the object at `path` (S3 answers the same whether or not
    /// there was one).
    ///
    /// # Errors
    /// The server's error, naming the key and root.
    pub fn remove_file(&self, path: &Path) -> io::Result<()> {
        let key = self.key(path)?;
        match self.call("delete", key.to_string(), move |st| async move {
            st.delete(&key).await
        }) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            r => r,
        }
    }

    /// Creates the object at `path` with `data` only if none is there
    /// (`If-None-Match: *`): `Ok(true)` when this call created it,
    /// `Ok(false)` when it existed.
    ///
    /// # Errors
    /// Other errors of the server, naming the key and root.
    pub fn put_if_absent(&self, path: &Path, data: &[u8]) -> io::Result<bool> {
        let key = self.key(path)?;
        let data = Bytes::copy_from_slice(data);
        match self.call("conditional put", key.to_string(), move |st| async move {
            st.put_opts(
                &key,
                PutPayload::from(data),
                PutOptions::from(PutMode::Create),
            )
            .await
            .map(|_| ())
        }) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Reads the staged chunks of file `f` (chunk indices `first..` of
    /// the manifest), in order, calling `each` with every chunk's bytes.
    fn chunks_of(
        &self,
        s: &str,
        f: &ferry_proto::manifest::FileEntry,
        cs: u32,
        mut each: impl FnMut(u64, Bytes) -> io::Result<()>,
    ) -> io::Result<()> {
        for ci in 0..chunk_count(f.size, cs) {
            let key = self.key_of_str(&chunk_key(s, &f.path, ci * u64::from(cs)));
            each(ci, self.get(key)?)?;
        }
        Ok(())
    }

    /// Writes file `f` from staging `s` to key `dst`, its chunks in one
    /// PUT or a multipart upload; `Ok(Some(key))` instead when staging
    /// shares the file with an earlier version's object `key`, which is
    /// kept where it is (checked to be what was shared).
    fn write_file(
        &self,
        s: &str,
        f: &ferry_proto::manifest::FileEntry,
        cs: u32,
        dst: Key,
    ) -> io::Result<Option<Key>> {
        if let Some((kept, holds)) = self.shared_holds(s, f)? {
            if !holds {
                return Err(self.changed_since_shared(&kept));
            }
            return Ok(Some(kept));
        }
        let n = chunk_count(f.size, cs);
        if f.size <= PART_TARGET {
            let mut data = Vec::with_capacity(f.size as usize);
            self.chunks_of(s, f, cs, |_, b| {
                data.extend_from_slice(&b);
                Ok(())
            })?;
            return self.put(dst, Bytes::from(data)).map(|()| None);
        }
        let mut k = PART_TARGET.div_ceil(u64::from(cs));
        if n.div_ceil(k) > MAX_PARTS {
            k = n.div_ceil(MAX_PARTS);
        }
        let d2 = dst.clone();
        let mut up = self.call("start upload", dst.to_string(), move |st| async move {
            st.put_multipart(&d2).await
        })?;
        let mut sizes = Vec::new();
        let mut part: Vec<u8> = Vec::new();
        let r = self.chunks_of(s, f, cs, |ci, b| {
            part.extend_from_slice(&b);
            if (ci + 1) % k == 0 || ci + 1 == n {
                sizes.push(part.len() as u64);
                let fut = up.put_part(PutPayload::from(std::mem::take(&mut part)));
                self.call("upload part", dst.to_string(), move |_| fut)?;
            }
            Ok(())
        });
        match r {
            Ok(()) => {
                self.call("complete upload", dst.to_string(), move |_| async move {
                    up.complete().await.map(|_| ())
                })?;
                if let Ok(mut p) = self.parts.lock() {
                    p.push(sizes);
                }
                Ok(None)
            }
            Err(e) => {
                let _ = self.call("abort upload", dst.to_string(), move |_| async move {
                    up.abort().await
                });
                Err(e)
            }
        }
    }
}

/// An object being written in order ([`S3::create_file`]). Only
/// [`S3Writer::close`] makes it visible; dropped unclosed, its multipart
/// upload (if one was started) is aborted and nothing is written, as for
/// an uploader that was killed.
pub struct S3Writer {
    store: S3,
    key: Key,
    /// Bytes of a part.
    part: usize,
    /// What is not sent yet (less than a part).
    buf: Vec<u8>,
    upload: Option<Box<dyn MultipartUpload>>,
    /// Sizes of the parts sent.
    sizes: Vec<u64>,
}

impl fmt::Debug for S3Writer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "S3Writer({} {})", self.store.root.url, self.key)
    }
}

impl S3Writer {
    /// Appends `bytes`, sending every part that fills up.
    ///
    /// # Errors
    /// The server's error for a part (the upload is aborted), naming the
    /// key and root; the writer is unusable afterwards.
    pub fn write(&mut self, mut bytes: &[u8]) -> io::Result<()> {
        while !bytes.is_empty() {
            // A full part goes out once more follows: an object of
            // exactly one part is one PUT.
            if self.buf.len() == self.part {
                self.send_part()?;
            }
            let n = (self.part - self.buf.len()).min(bytes.len());
            self.buf.extend_from_slice(&bytes[..n]);
            bytes = &bytes[n..];
        }
        Ok(())
    }

    fn send_part(&mut self) -> io::Result<()> {
        let mut up = match self.upload.take() {
            Some(up) => up,
            None => {
                let key = self.key.clone();
                self.store
                    .call("start upload", self.key.to_string(), move |st| async move {
                        st.put_multipart(&key).await
                    })?
            }
        };
        let data = std::mem::replace(&mut self.buf, Vec::with_capacity(self.part));
        let len = data.len() as u64;
        let fut = up.put_part(PutPayload::from(data));
        match self
            .store
            .call("upload part", self.key.to_string(), move |_| fut)
        {
            Ok(()) => {
                self.sizes.push(len);
                self.upload = Some(up);
                Ok(())
            }
            Err(e) => {
                self.upload = Some(up);
                self.abort();
                Err(e)
            }
        }
    }

    fn abort(&mut self) {
        if let Some(mut up) = self.upload.take() {
            let r = self
                .store
                .call("abort upload", self.key.to_string(), move |_| async move {
                    up.abort().await
                });
            if let Err(e) = r {
                tracing::warn!(error = %e, "aborting an S3 multipart upload");
            }
        }
    }

    /// Completes the object: one PUT of everything written, or the last
    /// part and the completion of the multipart upload.
    ///
    /// # Errors
    /// The server's error, naming the key and root (a multipart upload is
    /// aborted).
    pub fn close(mut self) -> io::Result<()> {
        if self.upload.is_none() {
            let data = Bytes::from(std::mem::take(&mut self.buf));
            return self.store.put(self.key.clone(), data);
        }
        if !self.buf.is_empty() {
            self.send_part()?;
        }
        let Some(mut up) = self.upload.take() else {
            return Ok(());
        };
        match self.store.call(
            "complete upload",
            self.key.to_string(),
            move |_| async move {
                match up.complete().await {
                    Ok(_) => Ok(()),
                    Err(e) => {
                        let _ = up.abort().await;
                        Err(e)
                    }
                }
            },
        ) {
            Ok(()) => {
                if let Ok(mut p) = self.store.parts.lock() {
                    p.push(std::mem::take(&mut self.sizes));
                }
                Ok(())
            }
            Err(e) => Err(e),
        }
    }
}

impl Drop for S3Writer {
    fn drop(&mut self) {
        self.abort();
    }
}

/// An object opened for ranged reads.
struct S3File {
    store: S3,
    key: Key,
    size: u64,
    /// The mtime its commit object records, if found through one.
    mtime_ns: Option<i64>,
}

impl RangeRead for S3File {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let data = self.read_range(offset, buf.len() as u64)?;
        buf.copy_from_slice(&data);
        Ok(())
    }

    fn read_range(&self, offset: u64, len: u64) -> io::Result<Vec<u8>> {
        if offset.saturating_add(len) > self.size {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "{} {}: {len} bytes at {offset}, the object has {}",
                    self.store.root.url, self.key, self.size
                ),
            ));
        }
        if len == 0 {
            return Ok(Vec::new());
        }
        let key = self.key.clone();
        let b = self
            .store
            .call("get", self.key.to_string(), move |st| async move {
                st.get_range(&key, offset..offset + len).await
            })?;
        Ok(b.to_vec())
    }

    fn current(&self) -> io::Result<(u64, i64, FileVersion)> {
        let m = self.store.head(self.key.clone())?.ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("{} {}: gone", self.store.root.url, self.key),
            )
        })?;
        Ok(Located {
            meta: m,
            mtime_ns: self.mtime_ns,
        }
        .stat())
    }
}

impl SourceStore for S3 {
    fn watch(&self, _root: &Path, _on_event: WatchHandler) -> io::Result<Option<Box<dyn Watch>>> {
        Ok(None)
    }

    fn list(&self, dir: &Path, markers: &[String]) -> Result<Listing, ScanError> {
        let io_err = |source| ScanError::Io {
            path: dir.to_path_buf(),
            source,
        };
        let d = self.root.check(dir).map_err(io_err)?;
        if let Some(c) = self.read_commit(&d).map_err(io_err)? {
            // A published replica or version: its commit object lists it
            // (its objects may be under another prefix). Sizes and version
            // tokens are the objects' own (one listing of the version's
            // prefix, and a HEAD for each kept file); a file whose object
            // is gone is left out.
            let c = Arc::new(c);
            self.cache_commit(&d, c.clone());
            let own = c
                .version
                .clone()
                .unwrap_or_else(|| d.trim_start_matches('/').to_string());
            let mut objects: HashMap<String, object_store::ObjectMeta> = self
                .list_keys(Key::from(own.as_str()))
                .map_err(io_err)?
                .into_iter()
                .map(|m| (m.location.to_string(), m))
                .collect();
            for k in c.kept.values() {
                if !objects.contains_key(k) {
                    if let Some(m) = self.head(Key::from(k.as_str())).map_err(io_err)? {
                        objects.insert(k.clone(), m);
                    }
                }
            }
            let files = c
                .files
                .iter()
                .filter(|f| !remote::skipped(&f.0))
                .filter_map(|(path, _, mode, mtime_ns)| {
                    let m = objects.get(&c.object(&d, path))?;
                    Some(Listed {
                        info: FileInfo {
                            path: path.clone(),
                            size: m.size,
                            mode: *mode,
                            mtime_ns: *mtime_ns,
                        },
                        version: version_of(m),
                    })
                })
                .collect();
            return Ok(remote::order(files, markers));
        }
        let prefix = self.key_of_str(&d);
        let all = self.list_keys(prefix.clone()).map_err(io_err)?;
        let strip = if prefix.as_ref().is_empty() {
            String::new()
        } else {
            format!("{}/", prefix.as_ref())
        };
        let mut files = Vec::new();
        for m in all {
            let Some(rel) = m.location.as_ref().strip_prefix(&strip) else {
                continue;
            };
            if remote::skipped(rel) {
                continue;
            }
            files.push(Listed {
                info: FileInfo {
                    path: rel.to_string(),
                    size: m.size,
                    mode: 0o644,
                    mtime_ns: m.last_modified.timestamp_nanos_opt().unwrap_or(0),
                },
                version: version_of(&m),
            });
        }
        if files.is_empty() {
            return Err(io_err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("{}: no objects under this prefix", self.root.url_of(dir)),
            )));
        }
        Ok(remote::order(files, markers))
    }

    fn open(&self, path: &Path) -> io::Result<Box<dyn RangeRead>> {
        let m = self.locate(path, true)?.ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("{}: no such object", self.root.url_of(path)),
            )
        })?;
        Ok(Box::new(S3File {
            store: self.clone(),
            key: m.meta.location,
            size: m.meta.size,
            mtime_ns: m.mtime_ns,
        }))
    }

    fn stat(&self, path: &Path) -> io::Result<(u64, i64, FileVersion)> {
        let m = self.locate(path, true)?.ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("{}: no such object", self.root.url_of(path)),
            )
        })?;
        Ok(m.stat())
    }
}

/// A staging area in a bucket: one object per chunk.
struct S3Staging {
    store: S3,
    dir: PathBuf,
}

impl Staging for S3Staging {
    fn stage_chunk(&mut self, rel: &str, offset: u64, bytes: &[u8]) -> io::Result<()> {
        ferry_proto::paths::check_relative(rel)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("{rel}: {e}")))?;
        let s = self.store.root.check(&self.dir)?;
        self.store.put(
            self.store.key_of_str(&chunk_key(&s, rel, offset)),
            Bytes::copy_from_slice(bytes),
        )
    }
}

impl SinkStore for S3 {
    fn staging(&self, dir: &Path) -> Box<dyn Staging> {
        Box::new(S3Staging {
            store: self.clone(),
            dir: dir.to_path_buf(),
        })
    }

    fn share_unchanged(&self, previous: &Path, staging: &Path, rel: &str) -> io::Result<()> {
        ferry_proto::paths::check_relative(rel)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("{rel}: {e}")))?;
        // No copy: staging records which object (and which ETag) the new
        // version keeps; the publish leaves it in place, and the new
        // commit object names it.
        let p = self.root.check(previous)?;
        let from = self
            .published_commit(&p)?
            .filter(|c| c.files.iter().any(|f| f.0 == rel))
            .map_or_else(
                || self.key_of_str(&format!("{p}/{rel}")),
                |c| Key::from(c.object(&p, rel)),
            );
        let m = self.head(from.clone())?.ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!(
                    "{}/{rel}: not in the published version",
                    self.root.url_of(previous)
                ),
            )
        })?;
        let r = SharedRef {
            key: from.to_string(),
            e_tag: m.e_tag,
            size: m.size,
        };
        let body = serde_json::to_vec(&r).map_err(io::Error::other)?;
        self.put(
            self.shared_key(&self.root.check(staging)?, rel),
            Bytes::from(body),
        )
    }

    fn publish(
        &self,
        staging: &Path,
        local_path: &Path,
        version: &Path,
        m: &Manifest,
        reread: Option<&[(u64, Hash)]>,
        _readers: Option<u64>,
    ) -> io::Result<PublishOutcome> {
        let s = self.root.check(staging)?;
        let l = self.root.check(local_path)?;
        let v = self.root.check(version)?;
        self.root.check_apart(&v, &l)?;
        let root = hex(&m.root());
        let vk = self.key_of_str(&v).to_string();
        let existing = self.read_commit(&l)?;
        if let Some(c) = existing
            .as_ref()
            .filter(|c| c.root == root && c.version.as_deref() == Some(vk.as_str()))
        {
            // This version is published: a crash came after the switch.
            // Objects a replica of an earlier release left under the path
            // (deleted after the switch) go now, but for those it keeps.
            self.delete_unkept_under(&l, c)?;
            return Ok(PublishOutcome::Recovered);
        }
        let mut reread_time = None;
        let commit = match self.read_commit(&v)? {
            // A crash after the version was complete, before the switch.
            Some(c) if c.root == root => c,
            Some(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!(
                        "{}: another checkpoint's version is there",
                        self.root.url_of(version)
                    ),
                ))
            }
            None => {
                let start = std::time::Instant::now();
                if let Some(want) = reread {
                    // Check every staged chunk before anything moves, a few files
                    // at once.
                    let firsts = remote::first_chunks(m);
                    let refetch = Mutex::new(Vec::new());
                    remote::for_each_parallel(self.publish_threads, m.files.len(), |fi| {
                        let f = &m.files[fi];
                        match self.shared_holds(&s, f)? {
                            Some((_, true)) => return Ok(()),
                            Some((_, false)) => {
                                // Changed since it was shared: sent again, staged
                                // as chunks.
                                let k = self.shared_key(&s, &f.path);
                                self.call("delete", k.to_string(), move |st| async move {
                                    st.delete(&k).await
                                })?;
                                let mut r = refetch.lock().unwrap_or_else(|p| p.into_inner());
                                for ci in 0..chunk_count(f.size, m.chunk_size) {
                                    r.push(want[firsts[fi] + ci as usize].0);
                                }
                                return Ok(());
                            }
                            None => {}
                        }
                        for ci in 0..chunk_count(f.size, m.chunk_size) {
                            let (k, h) = want[firsts[fi] + ci as usize];
                            let key = self.key_of_str(&chunk_key(
                                &s,
                                &f.path,
                                ci * u64::from(m.chunk_size),
                            ));
                            let ok = match self.get(key) {
                                Ok(b) => {
                                    b.len() as u64 == chunk_len(f.size, m.chunk_size, ci)
                                        && *blake3::hash(&b).as_bytes() == h
                                }
                                Err(e) if e.kind() == io::ErrorKind::NotFound => false,
                                Err(e) => return Err(e),
                            };
                            if !ok {
                                refetch.lock().unwrap_or_else(|p| p.into_inner()).push(k);
                            }
                        }
                        Ok(())
                    })?;
                    let mut refetch = refetch.into_inner().unwrap_or_else(|p| p.into_inner());
                    if !refetch.is_empty() {
                        refetch.sort_unstable();
                        return Ok(PublishOutcome::Refetch(refetch));
                    }
                }
                reread_time = reread.map(|_| start.elapsed());
                if reread.is_none() {
                    // Unread, a shared object that changed would only show when
                    // the files are written: check before anything moves.
                    remote::for_each_parallel(
                        self.publish_threads,
                        m.files.len(),
                        |fi| match self.shared_holds(&s, &m.files[fi])? {
                            Some((kept, false)) => Err(self.changed_since_shared(&kept)),
                            _ => Ok(()),
                        },
                    )?;
                }
                self.put(
                    self.key_of_str(&format!("{s}/.ferry-publishing")),
                    Bytes::from(l.clone().into_bytes()),
                )?;
                fault_point("placed");
                // The files under the version's own prefix, nothing at
                // the published path yet: non-markers a few at once, then
                // the markers in order, last. Shared files stay where the
                // earlier version has them.
                let kept = Mutex::new(BTreeMap::new());
                let write = |i: usize| {
                    let f = &m.files[i];
                    let dst = Key::from(format!("{vk}/{}", f.path));
                    if let Some(k) = self.write_file(&s, f, m.chunk_size, dst)? {
                        kept.lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .insert(f.path.clone(), k.to_string());
                    }
                    Ok(())
                };
                let is_marker = |i: usize| m.markers.iter().any(|&x| x as usize == i);
                let files: Vec<usize> = (0..m.files.len()).filter(|&i| !is_marker(i)).collect();
                remote::for_each_parallel(self.publish_threads, files.len(), |j| write(files[j]))?;
                for &i in &m.markers {
                    write(i as usize)?;
                }
                fault_point("markers-in");
                let c = Commit {
                    root: root.clone(),
                    files: m
                        .files
                        .iter()
                        .map(|f| (f.path.clone(), f.size, f.mode, f.mtime_ns))
                        .collect(),
                    version: Some(vk),
                    kept: kept.into_inner().unwrap_or_else(|p| p.into_inner()),
                };
                // The version's own commit object, by a conditional create:
                // of two publishers of one version exactly one wins.
                let body = serde_json::to_vec(&c).map_err(io::Error::other)?;
                if !self.put_if_absent(Path::new(&format!("{v}.ferry-commit")), &body)?
                    && self.read_commit(&v)?.is_none_or(|o| o.root != root)
                {
                    return Err(io::Error::new(
                        io::ErrorKind::AlreadyExists,
                        format!(
                            "{}: another publish created the version's commit object first",
                            self.root.url_of(version)
                        ),
                    ));
                }
                c
            }
        };
        // The switch: one PUT of the published path's commit object, which
        // names the version from then on (a reader sees the older commit
        // object or this one, each naming a whole version). The first
        // publish at a path creates it conditionally.
        let body = serde_json::to_vec(&commit).map_err(io::Error::other)?;
        let pointer = PathBuf::from(format!("{l}.ferry-commit"));
        if existing.is_some() {
            self.put(self.key(&pointer)?, Bytes::from(body))?;
        } else if !self.put_if_absent(&pointer, &body)? {
            return match self.read_commit(&l)? {
                Some(c) if c.root == root => Ok(PublishOutcome::Recovered),
                _ => Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!(
                        "{}: another publish created the commit object first",
                        self.root.url_of(local_path)
                    ),
                )),
            };
        }
        if existing.is_some_and(|c| c.version.is_none()) {
            // A replica published before versioned prefixes had its
            // objects under the published path: they go now, but for those
            // this version keeps.
            self.delete_unkept_under(&l, &commit)?;
        }
        Ok(PublishOutcome::Published {
            hot: None,
            reread: reread_time.map(ReadBack::wall_only),
        })
    }

    fn publish_under_way(&self, staging: &Path) -> bool {
        self.root
            .check(staging)
            .and_then(|s| self.head(self.key_of_str(&format!("{s}/.ferry-publishing"))))
            .map(|m| m.is_some())
            .unwrap_or(false)
    }

    fn publish_recorded(&self, staging: &Path) -> io::Result<()> {
        self.discard(staging)
    }

    fn discard(&self, staging: &Path) -> io::Result<()> {
        self.delete_prefix(self.key(staging)?).map(drop)
    }

    fn versioned(&self) -> bool {
        true
    }

    fn named_version(&self, local_path: &Path) -> io::Result<Option<PathBuf>> {
        let l = self.root.check(local_path)?;
        Ok(self
            .read_commit(&l)?
            .and_then(|c| c.version)
            .map(|v| PathBuf::from(format!("/{v}"))))
    }

    fn withdraw(
        &self,
        local_path: &Path,
        version: &Path,
        _aside: &Path,
        keep: &[PathBuf],
    ) -> io::Result<bool> {
        // Objects cannot move: the version is deleted here. The published
        // path's commit object goes first when it names this version (from
        // then on no reader takes the rest for a replica); then the
        // objects, but for those another version that stays names; the
        // version's own commit object last, so that a deletion cut short
        // is finished by calling again.
        let l = self.root.check(local_path)?;
        let v = self.root.check(version)?;
        let vk = self.key_of_str(&v).to_string();
        let pointer = self.read_commit(&l)?;
        let ours = self.read_commit(&v)?;
        let own_objects = self.list_keys(Key::from(vk.as_str()))?;
        // A replica published before versioned prefixes is the published
        // path itself (it has no version of its own).
        let legacy = pointer.as_ref().is_some_and(|c| c.version.is_none())
            && ours.is_none()
            && own_objects.is_empty();
        let mut did = false;
        if legacy || pointer.as_ref().and_then(|c| c.version.as_deref()) == Some(vk.as_str()) {
            let k = self.commit_key(&l);
            self.call("delete", k.to_string(), move |st| async move {
                st.delete(&k).await
            })?;
            did = true;
        }
        // What the versions that stay name: their kept objects, and their
        // own prefixes.
        let mut named: HashSet<String> = HashSet::new();
        let mut prefixes: Vec<String> = Vec::new();
        let mut others = Vec::new();
        for k in keep {
            others.push(self.read_commit(&self.root.check(k)?)?);
        }
        if !legacy {
            others.push(pointer.filter(|c| c.version.as_deref() != Some(vk.as_str())));
        }
        for c in others.into_iter().flatten() {
            named.extend(c.kept.into_values());
            prefixes.push(match c.version {
                Some(p) => format!("{p}/"),
                None => format!("{}/", l.trim_start_matches('/')),
            });
        }
        let mut gone: Vec<String> = if legacy {
            self.list_keys(self.key_of_str(&l))?
                .into_iter()
                .map(|m| m.location.to_string())
                .collect()
        } else {
            own_objects
                .into_iter()
                .map(|m| m.location.to_string())
                .collect()
        };
        if let Some(c) = &ours {
            gone.extend(
                c.kept
                    .values()
                    .filter(|k| !prefixes.iter().any(|p| k.starts_with(p.as_str())))
                    .cloned(),
            );
        }
        gone.retain(|k| !named.contains(k));
        did |= !gone.is_empty();
        self.delete_keys(
            self.root.url_of(version),
            gone.into_iter().map(Key::from).collect(),
        )?;
        if ours.is_some() {
            let k = self.commit_key(&v);
            self.call("delete", k.to_string(), move |st| async move {
                st.delete(&k).await
            })?;
            did = true;
        }
        Ok(did)
    }

    fn list_names(&self, dir: &Path) -> io::Result<Vec<String>> {
        let d = self.key(dir)?;
        let listed = self.call("list", d.to_string(), move |st| async move {
            st.list_with_delimiter(Some(&d)).await
        })?;
        let mut names: Vec<String> = listed
            .common_prefixes
            .iter()
            .chain(listed.objects.iter().map(|o| &o.location))
            .filter_map(|k| k.filename())
            .map(|n| n.strip_suffix(".ferry-commit").unwrap_or(n).to_string())
            .collect();
        names.sort();
        names.dedup();
        Ok(names)
    }

    fn located_url(&self, path: &Path) -> io::Result<Option<String>> {
        let l = self.root.check(path)?;
        if self.head(self.commit_key(&l))?.is_some() {
            // A replica or version: its URL, read through its commit object.
            return Ok(Some(self.root.url_of(path)));
        }
        Ok(Some(match self.locate(path, false)? {
            Some(m) => self
                .root
                .url_of(Path::new(&format!("/{}", m.meta.location))),
            None => self.root.url_of(path),
        }))
    }

    fn retire(&self, _aside: &Path) -> io::Result<()> {
        // [`S3::withdraw`] deleted the replica already.
        Ok(())
    }

    fn free_space(&self, _path: &Path) -> io::Result<Option<u64>> {
        let Some(cap) = self.capacity else {
            return Ok(None);
        };
        let used: u64 = self
            .list_keys(self.key_of_str(&self.root.path.to_string_lossy()))?
            .iter()
            .map(|m| m.size)
            .sum();
        Ok(Some(cap.saturating_sub(used)))
    }

    fn flush(&self, _dir: &Path) -> io::Result<()> {
        // A PUT is durable when it returns.
        Ok(())
    }

    fn capacity(&self, _path: &Path) -> io::Result<Option<u64>> {
        Ok(self.capacity)
    }

    fn exists(&self, path: &Path) -> io::Result<bool> {
        let l = self.root.check(path)?;
        // A published replica or version is its commit object; a file is
        // its object (where its replica's commit object says).
        Ok(self.head(self.commit_key(&l))?.is_some() || self.locate(path, false)?.is_some())
    }

    fn read_small(&self, path: &Path) -> io::Result<Option<Vec<u8>>> {
        match self.get(self.key(path)?) {
            Ok(b) => Ok(Some(b.to_vec())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn replace_small(&self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        // One PUT replaces an object whole.
        self.put(self.key(path)?, Bytes::copy_from_slice(bytes))
    }

    fn url_of(&self, path: &Path) -> Option<String> {
        Some(self.root.url_of(path))
    }
}

#[cfg(test)]
mod tests {
    use super::without_xml;

    #[test]
    fn an_error_of_the_metadata_service_says_no_credentials_were_given() {
        let e = super::io_of(object_store::Error::Generic {
            store: "S3",
            source: "Error performing PUT http://169.254.169.254/latest/api/token: 403 Forbidden"
                .into(),
        });
        assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied);
        let m = e.to_string();
        assert!(
            m.starts_with("no S3 credentials")
                && m.contains("AWS_ACCESS_KEY_ID")
                && m.contains("403"),
            "{m}"
        );
    }

    #[test]
    fn an_s3_error_document_is_cut_to_its_code_and_message() {
        let msg = "Client error with status 403 Forbidden: <?xml version=\"1.0\" \
                   encoding=\"UTF-8\"?>\n<Error><Code>SignatureDoesNotMatch</Code><Message>The \
                   request signature we calculated does not match.</Message><Resource>/ferry/x\
                   </Resource><RequestId>1836A</RequestId></Error>";
        assert_eq!(
            without_xml(msg),
            "Client error with status 403 Forbidden: SignatureDoesNotMatch: The request \
             signature we calculated does not match."
        );
        let tail = "Error after 3 retries: <Error><Code>NoSuchBucket</Code></Error> in 2.1s";
        assert_eq!(
            without_xml(tail),
            "Error after 3 retries: NoSuchBucket in 2.1s"
        );
        let plain = "Generic S3 error: connection refused";
        assert_eq!(without_xml(plain), plain);
        let broken = "status 500: <Error><Code>InternalError";
        assert!(without_xml(broken).starts_with("status 500: "));
    }
}
