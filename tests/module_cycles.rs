//! No import cycles among the modules of any workspace crate.
//!
//! Each top-level module of a crate (`src/foo.rs` with everything under
//! `src/foo/`) is one node; a path `crate::bar::...` (or `super::bar` from
//! a top-level module) written in `foo` is an edge `foo -> bar`. The crate
//! root (`lib.rs`, `main.rs`) is the parent of every module and is left
//! out, as are test modules (`#[cfg(test)] mod ...` and `tests.rs` files),
//! comments and string literals. A cycle fails the test, named with one
//! place that makes each of its edges.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// One use of another module: the file and line that make the edge.
#[derive(Debug, Clone)]
struct Site {
    file: String,
    line: usize,
}

/// Edges of one crate: from module to module, with the first site seen.
type Graph = BTreeMap<String, BTreeMap<String, Site>>;

/// Replaces comments, string and char literals with spaces (newlines
/// kept, so line numbers still match).
fn strip_comments_and_strings(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let blank = |c: u8| if c == b'\n' { b'\n' } else { b' ' };
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                out.push(b' ');
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                    depth += 1;
                    out.extend_from_slice(b"  ");
                    i += 2;
                } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                    depth -= 1;
                    out.extend_from_slice(b"  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(b[i]));
                    i += 1;
                }
            }
        } else if c == b'r'
            && (b.get(i + 1) == Some(&b'"') || b.get(i + 1) == Some(&b'#'))
            && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_'))
        {
            // Raw string: r"..." or r#"..."#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&b'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&b'"') {
                out.push(c);
                i += 1;
                continue;
            }
            j += 1;
            loop {
                if j >= b.len() {
                    break;
                }
                if b[j] == b'"'
                    && b[j + 1..]
                        .iter()
                        .take(hashes)
                        .filter(|&&h| h == b'#')
                        .count()
                        == hashes
                {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            for &x in &b[i..j.min(b.len())] {
                out.push(blank(x));
            }
            i = j;
        } else if c == b'"' {
            out.push(b' ');
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    out.push(b' ');
                    i += 1;
                }
                if i < b.len() {
                    out.push(blank(b[i]));
                    i += 1;
                }
            }
            out.push(b' ');
            i += 1;
        } else if c == b'\'' {
            // A char literal ('x', '\n', '\u{..}') or a lifetime ('a).
            let end = if b.get(i + 1) == Some(&b'\\') {
                b[i + 2..]
                    .iter()
                    .position(|&x| x == b'\'')
                    .map(|p| i + 2 + p)
            } else if b.get(i + 2) == Some(&b'\'') {
                Some(i + 2)
            } else {
                None
            };
            match end {
                Some(e) => {
                    out.extend(std::iter::repeat_n(b' ', e + 1 - i));
                    i = e + 1;
                }
                None => {
                    out.push(c);
                    i += 1;
                }
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Blanks every `#[cfg(test)]` item (a test module, or a `mod x;` line).
fn strip_test_modules(src: &str) -> String {
    let mut s = src.to_string();
    while let Some(at) = s.find("#[cfg(test)]") {
        let rest = &s[at..];
        // The item ends at its first `;` or at the `}` closing its first `{`,
        // whichever comes first.
        let semi = rest.find(';');
        let brace = rest.find('{');
        let end = match (semi, brace) {
            (Some(sc), Some(br)) if sc < br => sc + 1,
            (_, Some(br)) => {
                let mut depth = 0;
                let mut end = rest.len();
                for (k, ch) in rest[br..].char_indices() {
                    match ch {
                        '{' => depth += 1,
                        '}' => {
                            depth -= 1;
                            if depth == 0 {
                                end = br + k + 1;
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                end
            }
            (Some(sc), None) => sc + 1,
            (None, None) => rest.len(),
        };
        let blanked: String = rest[..end]
            .chars()
            .map(|c| if c == '\n' { '\n' } else { ' ' })
            .collect();
        s.replace_range(at..at + end, &blanked);
    }
    s
}

/// The top-level modules a path group names: `{a, b::c, self}` -> a, b.
fn group_heads(group: &str) -> Vec<String> {
    let mut heads = Vec::new();
    let mut depth = 0;
    let mut item = String::new();
    for ch in group.chars() {
        match ch {
            '{' => {
                depth += 1;
                item.push(ch);
            }
            '}' => {
                depth -= 1;
                item.push(ch);
            }
            ',' if depth == 0 => {
                heads.push(std::mem::take(&mut item));
            }
            _ => item.push(ch),
        }
    }
    heads.push(item);
    heads
        .iter()
        .filter_map(|i| {
            let head: String = i
                .trim()
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            (!head.is_empty() && head != "self").then_some(head)
        })
        .collect()
}

/// Top-level modules referred to from code `src` (comments, strings and
/// test modules already removed), with line numbers. `depth` is the
/// module's depth below the crate root (1 for `src/foo.rs`), so that
/// `super::` paths can be resolved.
fn references(src: &str, depth: usize) -> Vec<(String, usize)> {
    let mut refs = Vec::new();
    let b = src.as_bytes();
    let line_of = |pos: usize| src[..pos].bytes().filter(|&c| c == b'\n').count() + 1;
    let mut i = 0;
    while i < b.len() {
        let word_start = i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_');
        let (prefix_len, ups) = if word_start && src[i..].starts_with("crate") {
            (5, None)
        } else if word_start && src[i..].starts_with("super") {
            // Count the chain `super::super::...`.
            let mut n = 0;
            let mut j = i;
            while src[j..].starts_with("super") {
                n += 1;
                j += 5;
                let rest = src[j..].trim_start();
                if !rest.starts_with("::") {
                    break;
                }
                let skip = src[j..].len() - rest.len() + 2;
                let after = src[j + skip..].trim_start();
                if after.starts_with("super") {
                    j = src.len() - after.len();
                } else {
                    break;
                }
            }
            (j - i, Some(n))
        } else {
            i += 1;
            continue;
        };
        let after_kw = i + prefix_len;
        if b.get(after_kw)
            .is_some_and(|c| c.is_ascii_alphanumeric() || *c == b'_')
        {
            i += 1;
            continue;
        }
        // `super` that does not climb to the crate root stays inside the
        // same top-level module.
        if let Some(n) = ups {
            if n < depth {
                i = after_kw;
                continue;
            }
        }
        let rest = src[after_kw..].trim_start();
        if !rest.starts_with("::") {
            i = after_kw;
            continue;
        }
        let rest = rest[2..].trim_start();
        let line = line_of(i);
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth_b = 1;
            let mut end = group.len();
            for (k, ch) in group.char_indices() {
                match ch {
                    '{' => depth_b += 1,
                    '}' => {
                        depth_b -= 1;
                        if depth_b == 0 {
                            end = k;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            for h in group_heads(&group[..end]) {
                refs.push((h, line));
            }
        } else {
            let head: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !head.is_empty() {
                refs.push((head, line));
            }
        }
        i = after_kw;
    }
    refs
}

/// The module graph of one crate from its source files: `(path relative
/// to src/, text)`.
fn graph(files: &[(PathBuf, String)]) -> Graph {
    let top = |rel: &Path| -> Option<String> {
        let first = rel.components().next()?.as_os_str().to_str()?;
        let name = first.strip_suffix(".rs").unwrap_or(first);
        (!matches!(name, "lib" | "main" | "bin")).then(|| name.to_string())
    };
    let modules: BTreeSet<String> = files.iter().filter_map(|(p, _)| top(p)).collect();
    let mut g = Graph::new();
    for (rel, text) in files {
        let Some(from) = top(rel) else { continue };
        if rel.file_name().is_some_and(|n| n == "tests.rs") {
            continue;
        }
        // src/foo.rs and src/foo/mod.rs are depth 1; src/foo/bar.rs depth 2.
        let mut depth = rel.components().count();
        if rel.file_name().is_some_and(|n| n == "mod.rs") {
            depth -= 1;
        }
        let code = strip_test_modules(&strip_comments_and_strings(text));
        for (to, line) in references(&code, depth) {
            if to != from && modules.contains(&to) {
                g.entry(from.clone())
                    .or_default()
                    .entry(to)
                    .or_insert(Site {
                        file: rel.display().to_string(),
                        line,
                    });
            }
        }
    }
    g
}

/// Every cycle's nodes in order (one cycle per strongly connected
/// component of more than one module), found by Tarjan's algorithm.
fn cycles(g: &Graph) -> Vec<Vec<String>> {
    struct State<'a> {
        g: &'a Graph,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        next: usize,
        sccs: Vec<Vec<&'a str>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a str) {
        s.index.insert(v, s.next);
        s.low.insert(v, s.next);
        s.next += 1;
        s.stack.push(v);
        s.on_stack.insert(v);
        if let Some(out) = s.g.get(v) {
            for w in out.keys() {
                let w = w.as_str();
                if !s.index.contains_key(w) {
                    visit(s, w);
                    let lw = s.low[w];
                    let lv = s.low[v];
                    s.low.insert(v, lv.min(lw));
                } else if s.on_stack.contains(w) {
                    let iw = s.index[w];
                    let lv = s.low[v];
                    s.low.insert(v, lv.min(iw));
                }
            }
        }
        if s.low[v] == s.index[v] {
            let mut scc = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                scc.push(w);
                if w == v {
                    break;
                }
            }
            s.sccs.push(scc);
        }
    }
    let mut s = State {
        g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        next: 0,
        sccs: Vec::new(),
    };
    let nodes: BTreeSet<&str> = g
        .iter()
        .flat_map(|(k, v)| std::iter::once(k.as_str()).chain(v.keys().map(String::as_str)))
        .collect();
    for n in nodes {
        if !s.index.contains_key(n) {
            visit(&mut s, n);
        }
    }
    let mut out = Vec::new();
    for scc in s.sccs.into_iter().filter(|c| c.len() > 1) {
        let members: BTreeSet<&str> = scc.iter().copied().collect();
        // Walk from the smallest member inside the component back to it.
        let start = *members.iter().next().expect("non-empty component");
        let mut path = vec![start.to_string()];
        let mut seen = BTreeSet::from([start]);
        let mut cur = start;
        loop {
            let next = g[cur]
                .keys()
                .map(String::as_str)
                .filter(|w| members.contains(w))
                .find(|w| *w == start || !seen.contains(w));
            match next {
                Some(w) if w == start => break,
                Some(w) => {
                    seen.insert(w);
                    path.push(w.to_string());
                    cur = w;
                }
                None => break,
            }
        }
        out.push(path);
    }
    out
}

/// A cycle as `a -> b (a.rs:3) -> a (b.rs:9)`.
fn describe(g: &Graph, cycle: &[String]) -> String {
    let mut s = cycle[0].clone();
    for (k, from) in cycle.iter().enumerate() {
        let to = &cycle[(k + 1) % cycle.len()];
        match g.get(from).and_then(|o| o.get(to)) {
            Some(site) => s += &format!(" -> {to} ({}:{})", site.file, site.line),
            None => s += &format!(" -> {to}"),
        }
    }
    s
}

/// Every `.rs` file under `dir`, relative to it.
fn rust_files(dir: &Path, rel: &Path, out: &mut Vec<(PathBuf, String)>) {
    let Ok(entries) = std::fs::read_dir(dir.join(rel)) else {
        return;
    };
    for e in entries.flatten() {
        let name = PathBuf::from(e.file_name());
        let child = rel.join(&name);
        match e.file_type() {
            Ok(t) if t.is_dir() => rust_files(dir, &child, out),
            Ok(t) if t.is_file() && name.extension().is_some_and(|x| x == "rs") => {
                let text = std::fs::read_to_string(dir.join(&child))
                    .unwrap_or_else(|e| panic!("reading {}: {e}", child.display()));
                out.push((child, text));
            }
            _ => {}
        }
    }
}

#[test]
fn no_crate_has_an_import_cycle_among_its_modules() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let manifest: toml::Table = std::fs::read_to_string(root.join("Cargo.toml"))
        .expect("reading Cargo.toml")
        .parse()
        .expect("parsing Cargo.toml");
    let members: Vec<String> = manifest["workspace"]["members"]
        .as_array()
        .expect("workspace.members")
        .iter()
        .filter_map(|m| m.as_str().map(str::to_string))
        .collect();
    assert!(members.len() > 3, "workspace members: {members:?}");
    let mut failures = Vec::new();
    let mut modules_seen = 0;
    for m in &members {
        let src = root.join(m).join("src");
        let mut files = Vec::new();
        rust_files(&src, Path::new(""), &mut files);
        assert!(
            !files.is_empty(),
            "{m}: no Rust files under {}",
            src.display()
        );
        let g = graph(&files);
        modules_seen += g.len();
        for c in cycles(&g) {
            failures.push(format!("{m}: {}", describe(&g, &c)));
        }
    }
    // The walk found modules that import each other at all.
    assert!(
        modules_seen > 10,
        "only {modules_seen} modules with imports found"
    );
    assert!(
        failures.is_empty(),
        "import cycles among modules (a module and its submodules count as one):\n  {}",
        failures.join("\n  ")
    );
}

fn files(list: &[(&str, &str)]) -> Vec<(PathBuf, String)> {
    list.iter()
        .map(|(p, t)| (PathBuf::from(p), t.to_string()))
        .collect()
}

#[test]
fn a_cycle_through_a_submodule_and_a_group_import_is_named() {
    let f = files(&[
        ("lib.rs", "pub mod wire; pub mod manifest; pub mod paths;"),
        ("wire.rs", "use crate::{manifest::Manifest, paths};\n"),
        ("manifest.rs", "fn f() {}\n"),
        ("manifest/scan.rs", "\n\nuse super::super::wire::Reader;\n"),
        (
            "paths.rs",
            "// crate::wire in a comment\nconst S: &str = \"crate::wire\";\n",
        ),
    ]);
    let g = graph(&f);
    let c = cycles(&g);
    assert_eq!(c.len(), 1, "{g:?}");
    let text = describe(&g, &c[0]);
    assert_eq!(
        text,
        "manifest -> wire (manifest/scan.rs:3) -> manifest (wire.rs:1)"
    );
}

#[test]
fn comments_strings_tests_and_local_super_make_no_edge() {
    let f = files(&[
        ("lib.rs", "pub mod a; pub mod b;"),
        ("a.rs", "use crate::b::X;\n"),
        (
            "b.rs",
            "/* crate::a */ const S: &str = r#\"crate::a\"#;\nfn f<'a>(x: &'a str) -> char { 'c' }\n\
             mod inner { use super::X; }\n#[cfg(test)]\nmod tests { use crate::a::Y; }\n",
        ),
        ("b/tests.rs", "use crate::a::Z;"),
    ]);
    let g = graph(&f);
    assert!(cycles(&g).is_empty(), "{g:?}");
    assert!(g["a"].contains_key("b"));
    assert!(!g.contains_key("b"), "{g:?}");
    // The same edge written in code does make a cycle.
    let mut f2 = f.clone();
    f2[2].1.push_str("\nfn g() { crate::a::h() }\n");
    assert_eq!(cycles(&graph(&f2)).len(), 1);
}
