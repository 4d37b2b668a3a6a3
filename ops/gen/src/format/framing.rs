//! Byte framing of generated checkpoint files, free of file-system I/O:
//! torch.save ZIP archives, DCP `.distcp` concatenations, safetensors
//! files and a minimal pickle encoder.
//!
//! Everything writes into a [`Sink`]. The executor's sink is a real file
//! (paced, counted); [`Counter`] only adds up lengths, which is how a
//! layout learns every file's size and every DCP item's offset before a
//! byte is written.

use std::io;

use crc::{Crc, Digest, Table, CRC_32_ISO_HDLC};

/// CRC-32 as ZIP uses it (the ISO-HDLC polynomial), slice-by-16.
pub(super) static CRC32: Crc<u32, Table<16>> = Crc::<u32, Table<16>>::new(&CRC_32_ISO_HDLC);

/// Running CRC-32 of a ZIP entry.
pub(super) type Crc32 = Digest<'static, u32, Table<16>>;

/// Where the bytes of one file go.
pub(super) trait Sink {
    /// Appends `bytes`.
    fn put(&mut self, bytes: &[u8]) -> io::Result<()>;
    /// Appends `n` pseudo-random bytes, feeding them to `crc` when given.
    fn put_random(&mut self, n: u64, crc: Option<&mut Crc32>) -> io::Result<()>;
    /// Bytes appended so far.
    fn pos(&self) -> u64;
    /// A tensor of `bytes` bytes is now written in full.
    fn tensor_done(&mut self, _bytes: u64) {}
    /// Called once before the tail of a file whose close must wait (the
    /// ZIP central directory of a [`crate::format`] "late" file);
    /// returns when the file may be finished.
    fn hold(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A [`Sink`] that only counts bytes.
#[derive(Debug, Default)]
pub(super) struct Counter {
    pos: u64,
}

impl Sink for Counter {
    fn put(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.pos += bytes.len() as u64;
        Ok(())
    }

    fn put_random(&mut self, n: u64, _crc: Option<&mut Crc32>) -> io::Result<()> {
        self.pos += n;
        Ok(())
    }

    fn pos(&self) -> u64 {
        self.pos
    }
}

/// The bytes of one ZIP entry.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Data {
    /// Known bytes (pickles, version records).
    Bytes(Vec<u8>),
    /// This many pseudo-random bytes (tensor storage).
    Random(u64),
}

impl Data {
    /// Length in bytes.
    pub(super) fn len(&self) -> u64 {
        match self {
            Self::Bytes(b) => b.len() as u64,
            Self::Random(n) => *n,
        }
    }
}

/// One stored (uncompressed) ZIP entry.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Entry {
    /// Name inside the archive, e.g. `archive/data/0`.
    pub(super) name: String,
    /// Contents.
    pub(super) data: Data,
    /// Whether the entry is a tensor storage (counted in the summary).
    pub(super) tensor: bool,
}

/// The entries of one `torch.save` archive holding `storages` (bytes of
/// each tensor storage), in the order torch 2.x writes them: `data.pkl`,
/// `.format_version`, `.storage_alignment`, `byteorder`, `data/0..n`,
/// then `version` and `.data/serialization_id` when the writer closes.
///
/// `prefix` is the archive name: torch uses the file stem for a file and
/// `archive` for an in-memory buffer (DCP's per-item records). `pickle`
/// stands in for the pickled object; its exact contents do not matter to
/// anything that only frames the file.
pub(super) fn torch_archive(prefix: &str, pickle: Vec<u8>, storages: &[u64]) -> Vec<Entry> {
    let bytes = |name: &str, data: &[u8]| Entry {
        name: format!("{prefix}/{name}"),
        data: Data::Bytes(data.to_vec()),
        tensor: false,
    };
    let mut out = vec![
        Entry {
            name: format!("{prefix}/data.pkl"),
            data: Data::Bytes(pickle),
            tensor: false,
        },
        bytes(".format_version", b"1"),
        bytes(".storage_alignment", b"64"),
        bytes("byteorder", b"little"),
    ];
    out.extend(storages.iter().enumerate().map(|(k, &n)| Entry {
        name: format!("{prefix}/data/{k}"),
        data: Data::Random(n),
        tensor: true,
    }));
    out.push(bytes("version", b"3\n"));
    out.push(bytes(
        ".data/serialization_id",
        b"0123456789012345678901234567890123456789",
    ));
    out
}

/// Values above this need ZIP64 fields (`0xFFFF_FFFF` itself is the
/// "see ZIP64" sentinel, so it counts as too large).
const ZIP64_AT: u64 = 0xFFFF_FFFF;

/// Alignment of entry data within an archive (torch's `kFieldAlignment`).
const ALIGN: u64 = 64;

/// ZIP extra-field id torch uses for alignment padding (`"FB"`).
const PAD_FIELD: u16 = 0x4246;

/// Writes `entries` as one stored ZIP archive starting at the sink's
/// position, the way torch.save frames it: each entry's data 64-byte
/// aligned (relative to the archive start), then the central directory
/// and an End-of-Central-Directory record (with the ZIP64 record and
/// locator when an offset or size reaches 4 GiB). Offsets are relative to
/// the archive start, so an archive inside a `.distcp` is valid on its own.
///
/// Entries of [`Data::Random`] use a data descriptor (general-purpose flag
/// bit 3) carrying their CRC-32, so the file is only ever appended to.
/// With `hold`, [`Sink::hold`] is called before the central directory.
pub(super) fn write_zip(sink: &mut dyn Sink, entries: &[Entry], hold: bool) -> io::Result<()> {
    write_zip_with(sink, entries, hold, ZIP64_AT)
}

/// [`write_zip`] with a lower ZIP64 threshold, so tests can exercise the
/// ZIP64 records without writing 4 GiB.
pub(super) fn write_zip_with(
    sink: &mut dyn Sink,
    entries: &[Entry],
    hold: bool,
    zip64_at: u64,
) -> io::Result<()> {
    let base = sink.pos();
    let mut central = Vec::new();
    for entry in entries {
        let offset = sink.pos() - base;
        let size = entry.data.len();
        let streamed = matches!(entry.data, Data::Random(_));
        let big = size >= zip64_at;
        let crc = match &entry.data {
            Data::Bytes(b) => CRC32.checksum(b),
            Data::Random(_) => 0,
        };
        let flags: u16 = if streamed { 0x0008 } else { 0 };
        let name = entry.name.as_bytes();
        let mut extra = Vec::new();
        if big {
            // Local ZIP64 extra: uncompressed and compressed size (zero
            // when a data descriptor follows).
            let known = if streamed { 0 } else { size };
            extra.extend_from_slice(&1u16.to_le_bytes());
            extra.extend_from_slice(&16u16.to_le_bytes());
            extra.extend_from_slice(&known.to_le_bytes());
            extra.extend_from_slice(&known.to_le_bytes());
        }
        let unpadded = offset + 30 + name.len() as u64 + extra.len() as u64 + 4;
        let pad = (ALIGN - unpadded % ALIGN) % ALIGN;
        extra.extend_from_slice(&PAD_FIELD.to_le_bytes());
        extra.extend_from_slice(&(pad as u16).to_le_bytes());
        extra.resize(extra.len() + pad as usize, b'Z');

        let header_size = match (big, streamed) {
            (true, _) => 0xFFFF_FFFF,
            (false, true) => 0,
            (false, false) => size as u32,
        };
        let mut h = Vec::with_capacity(30 + name.len() + extra.len());
        h.extend_from_slice(&0x0403_4b50u32.to_le_bytes());
        h.extend_from_slice(&(if big { 45u16 } else { 20 }).to_le_bytes());
        h.extend_from_slice(&flags.to_le_bytes());
        h.extend_from_slice(&0u16.to_le_bytes()); // stored
        h.extend_from_slice(&0u16.to_le_bytes()); // time
        h.extend_from_slice(&0x0021u16.to_le_bytes()); // date 1980-01-01
        h.extend_from_slice(&crc.to_le_bytes());
        h.extend_from_slice(&header_size.to_le_bytes());
        h.extend_from_slice(&header_size.to_le_bytes());
        h.extend_from_slice(&(name.len() as u16).to_le_bytes());
        h.extend_from_slice(&(extra.len() as u16).to_le_bytes());
        h.extend_from_slice(name);
        h.extend_from_slice(&extra);
        sink.put(&h)?;

        let crc = match &entry.data {
            Data::Bytes(b) => {
                sink.put(b)?;
                crc
            }
            Data::Random(n) => {
                let mut digest = CRC32.digest();
                sink.put_random(*n, Some(&mut digest))?;
                let crc = digest.finalize();
                let mut d = Vec::with_capacity(24);
                d.extend_from_slice(&0x0807_4b50u32.to_le_bytes());
                d.extend_from_slice(&crc.to_le_bytes());
                if big {
                    d.extend_from_slice(&n.to_le_bytes());
                    d.extend_from_slice(&n.to_le_bytes());
                } else {
                    d.extend_from_slice(&(*n as u32).to_le_bytes());
                    d.extend_from_slice(&(*n as u32).to_le_bytes());
                }
                sink.put(&d)?;
                crc
            }
        };
        if entry.tensor {
            sink.tensor_done(size);
        }
        central.extend(central_entry(name, flags, crc, size, offset, zip64_at));
    }
    if hold {
        sink.hold()?;
    }
    let cd_offset = sink.pos() - base;
    let cd_size = central.len() as u64;
    let mut tail = central;
    let count = entries.len() as u64;
    if cd_offset >= zip64_at || cd_size >= zip64_at || count >= 0xFFFF {
        let record = cd_offset + cd_size;
        tail.extend_from_slice(&0x0606_4b50u32.to_le_bytes());
        tail.extend_from_slice(&44u64.to_le_bytes());
        tail.extend_from_slice(&45u16.to_le_bytes());
        tail.extend_from_slice(&45u16.to_le_bytes());
        tail.extend_from_slice(&0u32.to_le_bytes());
        tail.extend_from_slice(&0u32.to_le_bytes());
        tail.extend_from_slice(&count.to_le_bytes());
        tail.extend_from_slice(&count.to_le_bytes());
        tail.extend_from_slice(&cd_size.to_le_bytes());
        tail.extend_from_slice(&cd_offset.to_le_bytes());
        tail.extend_from_slice(&0x0706_4b50u32.to_le_bytes());
        tail.extend_from_slice(&0u32.to_le_bytes());
        tail.extend_from_slice(&record.to_le_bytes());
        tail.extend_from_slice(&1u32.to_le_bytes());
    }
    tail.extend_from_slice(&0x0605_4b50u32.to_le_bytes());
    tail.extend_from_slice(&0u16.to_le_bytes());
    tail.extend_from_slice(&0u16.to_le_bytes());
    tail.extend_from_slice(&(count.min(0xFFFF) as u16).to_le_bytes());
    tail.extend_from_slice(&(count.min(0xFFFF) as u16).to_le_bytes());
    tail.extend_from_slice(&clamp32(cd_size, zip64_at).to_le_bytes());
    tail.extend_from_slice(&clamp32(cd_offset, zip64_at).to_le_bytes());
    tail.extend_from_slice(&0u16.to_le_bytes());
    sink.put(&tail)
}

/// `v` as a 32-bit ZIP field, or the ZIP64 sentinel.
fn clamp32(v: u64, zip64_at: u64) -> u32 {
    if v >= zip64_at {
        0xFFFF_FFFF
    } else {
        v as u32
    }
}

/// One central-directory record.
fn central_entry(
    name: &[u8],
    flags: u16,
    crc: u32,
    size: u64,
    offset: u64,
    zip64_at: u64,
) -> Vec<u8> {
    let mut extra = Vec::new();
    if size >= zip64_at {
        extra.extend_from_slice(&size.to_le_bytes());
        extra.extend_from_slice(&size.to_le_bytes());
    }
    if offset >= zip64_at {
        extra.extend_from_slice(&offset.to_le_bytes());
    }
    let zip64 = !extra.is_empty();
    if zip64 {
        let mut head = Vec::with_capacity(4 + extra.len());
        head.extend_from_slice(&1u16.to_le_bytes());
        head.extend_from_slice(&(extra.len() as u16).to_le_bytes());
        head.extend_from_slice(&extra);
        extra = head;
    }
    let version: u16 = if zip64 { 45 } else { 20 };
    let mut c = Vec::with_capacity(46 + name.len() + extra.len());
    c.extend_from_slice(&0x0201_4b50u32.to_le_bytes());
    c.extend_from_slice(&version.to_le_bytes()); // made by
    c.extend_from_slice(&version.to_le_bytes()); // needed
    c.extend_from_slice(&flags.to_le_bytes());
    c.extend_from_slice(&0u16.to_le_bytes()); // stored
    c.extend_from_slice(&0u16.to_le_bytes()); // time
    c.extend_from_slice(&0x0021u16.to_le_bytes()); // date
    c.extend_from_slice(&crc.to_le_bytes());
    c.extend_from_slice(&clamp32(size, zip64_at).to_le_bytes());
    c.extend_from_slice(&clamp32(size, zip64_at).to_le_bytes());
    c.extend_from_slice(&(name.len() as u16).to_le_bytes());
    c.extend_from_slice(&(extra.len() as u16).to_le_bytes());
    c.extend_from_slice(&0u16.to_le_bytes()); // comment
    c.extend_from_slice(&0u16.to_le_bytes()); // disk
    c.extend_from_slice(&0u16.to_le_bytes()); // internal attributes
    c.extend_from_slice(&0u32.to_le_bytes()); // external attributes
    c.extend_from_slice(&clamp32(offset, zip64_at).to_le_bytes());
    c.extend_from_slice(name);
    c.extend_from_slice(&extra);
    c
}

/// One record of a DCP `.distcp` file.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Item {
    /// A non-tensor value, written as raw pickle bytes (DCP's `BYTE_IO`
    /// items; DCP writes them before the tensors).
    Bytes(Vec<u8>),
    /// A tensor, written as its own `torch.save` archive.
    Archive(Vec<Entry>),
}

/// Writes DCP items one after another (PyTorch DCP's `FileSystemWriter`
/// with `single_file_per_rank`: one `torch.save` record per tensor,
/// appended) and returns each item's `(offset, length)` in the file.
/// With `hold`, the last archive's central directory waits for
/// [`Sink::hold`].
pub(super) fn write_distcp(
    sink: &mut dyn Sink,
    items: &[Item],
    hold: bool,
) -> io::Result<Vec<(u64, u64)>> {
    let mut spans = Vec::with_capacity(items.len());
    for (k, item) in items.iter().enumerate() {
        let start = sink.pos();
        match item {
            Item::Bytes(b) => sink.put(b)?,
            Item::Archive(entries) => write_zip(sink, entries, hold && k + 1 == items.len())?,
        }
        spans.push((start, sink.pos() - start));
    }
    Ok(spans)
}

/// One tensor of a safetensors file.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct StTensor {
    /// Tensor name, e.g. `model.layers.0.mlp.up_proj.weight`.
    pub(super) name: String,
    /// safetensors dtype, e.g. `BF16`, `F32`.
    pub(super) dtype: &'static str,
    /// Element count (the tensor is stored 1-D: `shape = [elems]`).
    pub(super) elems: u64,
    /// Bytes of data.
    pub(super) bytes: u64,
}

/// The header of a safetensors file holding `tensors` in this order: the
/// 8-byte little-endian length `N`, then `N` bytes of JSON (`__metadata__`
/// `{"format": "pt"}`, then per tensor `dtype`, `shape` and `data_offsets`
/// relative to byte `8 + N`), padded with spaces to a multiple of 8 as
/// safetensors does. The file is `8 + N + sum(bytes)` long.
pub(super) fn safetensors_header(tensors: &[StTensor]) -> Vec<u8> {
    let mut json = String::from(r#"{"__metadata__":{"format":"pt"}"#);
    let mut at = 0u64;
    for t in tensors {
        let name = serde_json::Value::String(t.name.clone()).to_string();
        json.push_str(&format!(
            r#",{name}:{{"dtype":"{}","shape":[{}],"data_offsets":[{},{}]}}"#,
            t.dtype,
            t.elems,
            at,
            at + t.bytes
        ));
        at += t.bytes;
    }
    json.push('}');
    while json.len() % 8 != 0 {
        json.push(' ');
    }
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(json.as_bytes());
    out
}

/// Writes a safetensors file: `header` (from [`safetensors_header`]),
/// then each tensor's data.
pub(super) fn write_safetensors(
    sink: &mut dyn Sink,
    header: &[u8],
    tensors: &[StTensor],
) -> io::Result<()> {
    sink.put(header)?;
    for t in tensors {
        sink.put_random(t.bytes, None)?;
        sink.tensor_done(t.bytes);
    }
    Ok(())
}

/// A Python value for [`pickle`].
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Py {
    /// `dict`, in insertion order.
    Dict(Vec<(Py, Py)>),
    /// `int`.
    Int(i64),
    /// `list`.
    List(Vec<Py>),
    /// `None`.
    None,
    /// `str`.
    Str(String),
    /// `tuple`.
    Tuple(Vec<Py>),
}

/// Encodes `value` as a protocol-2 pickle (no memo), which Python's
/// `pickle.loads` reads back. Used for DCP `.metadata` and as the
/// `data.pkl` stand-in of torch.save archives.
pub(super) fn pickle(value: &Py) -> Vec<u8> {
    let mut out = vec![0x80, 2];
    encode(value, &mut out);
    out.push(b'.');
    out
}

fn encode(value: &Py, out: &mut Vec<u8>) {
    match value {
        Py::None => out.push(b'N'),
        Py::Int(v) => {
            if let Ok(b) = u8::try_from(*v) {
                out.push(b'K');
                out.push(b);
            } else if let Ok(w) = u16::try_from(*v) {
                out.push(b'M');
                out.extend_from_slice(&w.to_le_bytes());
            } else if let Ok(i) = i32::try_from(*v) {
                out.push(b'J');
                out.extend_from_slice(&i.to_le_bytes());
            } else {
                // LONG1: 8 bytes of little-endian two's complement.
                out.push(0x8a);
                out.push(8);
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        Py::Str(s) => {
            out.push(b'X');
            out.extend_from_slice(&(s.len() as u32).to_le_bytes());
            out.extend_from_slice(s.as_bytes());
        }
        Py::Tuple(items) => {
            out.push(b'(');
            items.iter().for_each(|v| encode(v, out));
            out.push(b't');
        }
        Py::List(items) => {
            out.push(b']');
            if !items.is_empty() {
                out.push(b'(');
                items.iter().for_each(|v| encode(v, out));
                out.push(b'e');
            }
        }
        Py::Dict(items) => {
            out.push(b'}');
            if !items.is_empty() {
                out.push(b'(');
                for (k, v) in items {
                    encode(k, out);
                    encode(v, out);
                }
                out.push(b'u');
            }
        }
    }
}

/// The End-of-Central-Directory facts found at the tail of a ZIP archive
/// (or of a `.distcp`, whose last item is an archive).
#[cfg(test)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Eocd {
    /// Start of the archive in the buffer.
    pub(super) archive_start: u64,
    /// Offset of the central directory, relative to the archive start.
    pub(super) cd_offset: u64,
    /// Size of the central directory.
    pub(super) cd_size: u64,
    /// Number of entries.
    pub(super) entries: u64,
}

/// Reads the EOCD (and the ZIP64 record when the EOCD points to it) at the
/// very end of `buf`, checks that the central directory lies inside the
/// buffer and starts with a central-directory signature, and returns its
/// facts; `None` for a buffer that does not end in a whole archive (e.g.
/// a truncated file: "failed finding central directory").
#[cfg(test)]
pub(super) fn tail_eocd(buf: &[u8]) -> Option<Eocd> {
    let u16_at = |p: usize| Some(u16::from_le_bytes(buf.get(p..p + 2)?.try_into().ok()?));
    let u32_at = |p: usize| Some(u32::from_le_bytes(buf.get(p..p + 4)?.try_into().ok()?));
    let u64_at = |p: usize| Some(u64::from_le_bytes(buf.get(p..p + 8)?.try_into().ok()?));
    let eocd = buf.len().checked_sub(22)?;
    if u32_at(eocd)? != 0x0605_4b50 {
        return None;
    }
    let mut entries = u64::from(u16_at(eocd + 10)?);
    let mut cd_size = u64::from(u32_at(eocd + 12)?);
    let mut cd_offset = u64::from(u32_at(eocd + 16)?);
    let mut end_of_cd = eocd as u64;
    if cd_offset == 0xFFFF_FFFF || cd_size == 0xFFFF_FFFF || entries == 0xFFFF {
        let locator = eocd.checked_sub(20)?;
        if u32_at(locator)? != 0x0706_4b50 {
            return None;
        }
        let record = locator.checked_sub(56)?;
        if u32_at(record)? != 0x0606_4b50 {
            return None;
        }
        entries = u64_at(record + 32)?;
        cd_size = u64_at(record + 40)?;
        cd_offset = u64_at(record + 48)?;
        end_of_cd = record as u64;
    }
    let archive_start = end_of_cd.checked_sub(cd_size)?.checked_sub(cd_offset)?;
    let cd = usize::try_from(archive_start + cd_offset).ok()?;
    if entries > 0 && u32_at(cd)? != 0x0201_4b50 {
        return None;
    }
    Some(Eocd {
        archive_start,
        cd_offset,
        cd_size,
        entries,
    })
}

/// Reads every central-directory record: (name, crc, size, offset of
/// the local header), following ZIP64 extras.
#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(super) fn central_directory(buf: &[u8], e: Eocd) -> Vec<(String, u32, u64, u64)> {
    let mut p = (e.archive_start + e.cd_offset) as usize;
    let mut out = Vec::new();
    for _ in 0..e.entries {
        assert_eq!(&buf[p..p + 4], b"PK\x01\x02");
        let rd16 = |q: usize| u16::from_le_bytes(buf[q..q + 2].try_into().unwrap()) as usize;
        let rd32 = |q: usize| u32::from_le_bytes(buf[q..q + 4].try_into().unwrap());
        let crc = rd32(p + 16);
        let mut size = u64::from(rd32(p + 24));
        let mut offset = u64::from(rd32(p + 42));
        let (n, x) = (rd16(p + 28), rd16(p + 30));
        let name = String::from_utf8(buf[p + 46..p + 46 + n].to_vec()).unwrap();
        let mut extra = &buf[p + 46 + n..p + 46 + n + x];
        if !extra.is_empty() {
            assert_eq!(&extra[..2], &[1, 0]);
            extra = &extra[4..];
            let mut next = || {
                let v = u64::from_le_bytes(extra[..8].try_into().unwrap());
                extra = &extra[8..];
                v
            };
            if size == 0xFFFF_FFFF {
                size = next();
                assert_eq!(next(), size);
            }
            if offset == 0xFFFF_FFFF {
                offset = next();
            }
        }
        out.push((name, crc, size, offset));
        p += 46 + n + x;
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A sink into memory with zero-filled "random" bytes.
    #[derive(Default)]
    struct Memory(Vec<u8>);

    impl Sink for Memory {
        fn put(&mut self, bytes: &[u8]) -> io::Result<()> {
            self.0.extend_from_slice(bytes);
            Ok(())
        }
        fn put_random(&mut self, n: u64, crc: Option<&mut Crc32>) -> io::Result<()> {
            let chunk: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8).collect();
            if let Some(c) = crc {
                c.update(&chunk);
            }
            self.0.extend_from_slice(&chunk);
            Ok(())
        }
        fn pos(&self) -> u64 {
            self.0.len() as u64
        }
    }

    fn archive(zip64_at: u64) -> (Vec<u8>, Vec<Entry>) {
        let entries = torch_archive("model", pickle(&Py::Dict(vec![])), &[1000, 5, 70_000]);
        let mut m = Memory::default();
        m.put(b"leading bytes").unwrap();
        write_zip_with(&mut m, &entries, false, zip64_at).unwrap();
        (m.0, entries)
    }

    fn check_archive(buf: &[u8], entries: &[Entry]) {
        let e = tail_eocd(buf).unwrap();
        assert_eq!(e.archive_start, 13);
        assert_eq!(e.entries, entries.len() as u64);
        let start = e.archive_start as usize;
        for ((name, crc, size, offset), want) in central_directory(buf, e).into_iter().zip(entries)
        {
            assert_eq!(name, want.name);
            assert_eq!(size, want.data.len());
            let lh = start + offset as usize;
            assert_eq!(&buf[lh..lh + 4], b"PK\x03\x04");
            let n = u16::from_le_bytes(buf[lh + 26..lh + 28].try_into().unwrap()) as usize;
            let x = u16::from_le_bytes(buf[lh + 28..lh + 30].try_into().unwrap()) as usize;
            let data = lh + 30 + n + x;
            assert_eq!((data - start) % 64, 0, "{name} data is 64-byte aligned");
            let bytes = &buf[data..data + size as usize];
            assert_eq!(CRC32.checksum(bytes), crc, "{name}");
            if let Data::Bytes(b) = &want.data {
                assert_eq!(bytes, &b[..]);
            }
        }
    }

    #[test]
    fn zip_archive_has_aligned_entries_crcs_and_a_tail_eocd() {
        let (buf, entries) = archive(ZIP64_AT);
        check_archive(&buf, &entries);
        let mut counter = Counter::default();
        counter.put(b"leading bytes").unwrap();
        write_zip(&mut counter, &entries, false).unwrap();
        assert_eq!(
            counter.pos(),
            buf.len() as u64,
            "the counter predicts the size"
        );
        // A cut archive has no EOCD at its tail.
        assert!(tail_eocd(&buf[..buf.len() - 1]).is_none());
        assert!(tail_eocd(&buf[..buf.len() / 2]).is_none());
    }

    #[test]
    fn zip64_records_when_offsets_reach_the_threshold() {
        let (buf, entries) = archive(0);
        let e = tail_eocd(&buf).unwrap();
        // ZIP64 record + locator sit before the classic EOCD.
        let eocd = buf.len() - 22;
        assert_eq!(&buf[eocd - 20..eocd - 16], b"PK\x06\x07");
        assert_eq!(&buf[eocd - 76..eocd - 72], b"PK\x06\x06");
        assert_eq!(e.entries, entries.len() as u64);
        check_archive(&buf, &entries);
    }

    #[test]
    fn distcp_items_are_appended_and_spans_cover_the_file() {
        let items = vec![
            Item::Bytes(pickle(&Py::Int(7))),
            Item::Archive(torch_archive("archive", pickle(&Py::None), &[100])),
            Item::Archive(torch_archive("archive", pickle(&Py::None), &[20_000])),
        ];
        let mut m = Memory::default();
        let spans = write_distcp(&mut m, &items, false).unwrap();
        assert_eq!(spans[0].0, 0);
        for w in spans.windows(2) {
            assert_eq!(w[0].0 + w[0].1, w[1].0);
        }
        let (last_at, last_len) = spans[2];
        assert_eq!(last_at + last_len, m.0.len() as u64);
        let e = tail_eocd(&m.0).unwrap();
        assert_eq!(e.archive_start, last_at, "the tail EOCD is the last item's");
        assert!(e.cd_offset + e.cd_size < last_len);
    }

    #[test]
    fn safetensors_header_is_padded_json_with_contiguous_offsets() {
        let tensors = vec![
            StTensor {
                name: "a.weight".into(),
                dtype: "BF16",
                elems: 3,
                bytes: 6,
            },
            StTensor {
                name: "b\"q".into(),
                dtype: "F32",
                elems: 2,
                bytes: 8,
            },
        ];
        let h = safetensors_header(&tensors);
        let n = u64::from_le_bytes(h[..8].try_into().unwrap()) as usize;
        assert_eq!(h.len(), 8 + n);
        assert_eq!(n % 8, 0);
        let json: serde_json::Value = serde_json::from_slice(&h[8..]).unwrap();
        assert_eq!(json["__metadata__"]["format"], "pt");
        assert_eq!(json["a.weight"]["data_offsets"], serde_json::json!([0, 6]));
        assert_eq!(json["b\"q"]["data_offsets"], serde_json::json!([6, 14]));
        assert_eq!(json["b\"q"]["shape"], serde_json::json!([2]));
    }

    #[test]
    fn pickle_opcodes() {
        assert_eq!(pickle(&Py::None), b"\x80\x02N.");
        assert_eq!(pickle(&Py::Int(5)), b"\x80\x02K\x05.");
        assert_eq!(pickle(&Py::Int(300)), b"\x80\x02M\x2c\x01.");
        assert_eq!(pickle(&Py::Int(-1)), b"\x80\x02J\xff\xff\xff\xff.");
        assert_eq!(
            pickle(&Py::Int(1 << 40)),
            b"\x80\x02\x8a\x08\x00\x00\x00\x00\x00\x01\x00\x00."
        );
        assert_eq!(pickle(&Py::List(vec![])), b"\x80\x02].");
        assert_eq!(
            pickle(&Py::Dict(vec![(Py::Str("k".into()), Py::Tuple(vec![]))])),
            b"\x80\x02}(X\x01\x00\x00\x00k(tu."
        );
    }
}
