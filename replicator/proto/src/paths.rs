//! Validation of paths that come from a peer, so that the sink can never be
//! made to write outside its sink root.

use std::path::{Component, Path};

/// Why a path from a peer was refused.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error("refused path {path:?}: {why}")]
pub struct PathError {
    /// The offending path (as received).
    pub path: String,
    /// What is wrong with it.
    pub why: &'static str,
}

/// Checks that `path` is a non-empty relative path of plain `/`-separated
/// names: no `..`, no `.`, no empty component, no absolute path, no NUL
/// byte, no backslash, at most [`crate::limits::MAX_PATH`] bytes and 255
/// bytes per component.
///
/// # Errors
/// [`PathError`] naming the path and the rule it breaks.
pub fn check_relative(path: &str) -> Result<(), PathError> {
    let err = |why| {
        Err(PathError {
            path: path.chars().take(200).collect(),
            why,
        })
    };
    if path.is_empty() {
        return err("empty path");
    }
    if path.len() > crate::limits::MAX_PATH {
        return err("longer than 4096 bytes");
    }
    if path.contains('\0') {
        return err("contains a NUL byte");
    }
    if path.contains('\\') {
        return err("contains a backslash");
    }
    if path.starts_with('/') {
        return err("absolute path");
    }
    for part in path.split('/') {
        match part {
            "" => return err("empty component"),
            "." | ".." => return err("contains . or .."),
            p if p.len() > 255 => return err("component longer than 255 bytes"),
            _ => {}
        }
    }
    // Belt and braces: the std parser must agree that only normal
    // components are present.
    if !Path::new(path)
        .components()
        .all(|c| matches!(c, Component::Normal(_)))
    {
        return err("not a plain relative path");
    }
    Ok(())
}

/// Checks that `name` is a single path component usable as a directory
/// name (a site or job name): same rules as [`check_relative`] and no `/`.
///
/// # Errors
/// [`PathError`] naming the value and the rule it breaks.
pub fn check_name(name: &str) -> Result<(), PathError> {
    check_relative(name)?;
    if name.contains('/') {
        return Err(PathError {
            path: name.into(),
            why: "must be a single name without /",
        });
    }
    if name.starts_with('.') {
        return Err(PathError {
            path: name.into(),
            why: "must not start with a dot",
        });
    }
    Ok(())
}

/// True for names that checkpoint writers use for temporary files, which
/// are never part of a replica (docs/CHECKPOINT_FORMATS.md, "Publish rule":
/// `*.tmp`, `.tmp*`, `*_tmp_*`, `*.orbax-checkpoint-tmp*`, `*-unfinished`).
pub fn is_temporary(file_name: &str) -> bool {
    file_name.ends_with(".tmp")
        || file_name.starts_with(".tmp")
        || file_name.contains("_tmp_")
        || file_name.contains(".orbax-checkpoint-tmp")
        || file_name.ends_with("-unfinished")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostile_paths_are_refused() {
        for bad in [
            "",
            "/etc/passwd",
            "../x",
            "a/../../x",
            "a/./b",
            "a//b",
            "a/",
            "a\0b",
            "a\\..\\b",
            "..",
            ".",
        ] {
            assert!(check_relative(bad).is_err(), "{bad:?} accepted");
        }
        assert!(check_relative(&"a/".repeat(3000)).is_err());
        assert!(check_relative(&"x".repeat(256)).is_err());
    }

    #[test]
    fn plain_paths_are_accepted() {
        for good in [
            "a",
            "a/b.bin",
            ".metadata",
            "model/layers.0.attn.bin",
            "é/ü",
        ] {
            assert_eq!(check_relative(good), Ok(()));
        }
        assert!(check_name("job-1").is_ok());
        assert!(check_name("a/b").is_err());
        assert!(check_name(".ferry").is_err());
    }

    #[test]
    fn temporaries_follow_the_publish_rule() {
        assert!(is_temporary(".metadata.tmp"));
        assert!(is_temporary(".tmpfpjWc8"));
        assert!(is_temporary("x_tmp_3"));
        assert!(is_temporary("1.orbax-checkpoint-tmp-17"));
        assert!(is_temporary("run-unfinished"));
        assert!(!is_temporary(".metadata"));
        assert!(!is_temporary("model-00001-of-00003.safetensors"));
    }
}
