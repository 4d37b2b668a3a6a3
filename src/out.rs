//! Printing to stdout without panicking when it is closed: `ferry status
//! --json | head -1` closes the pipe after one line, and `println!` would
//! panic ("failed printing to stdout: Broken pipe").
//!
//! What a command prints as its result goes through [`print`] (or the
//! [`outln!`] macro): a closed stdout ends the command with
//! [`StdoutClosed`], which `main` turns into a quiet exit with
//! [`CLOSED_EXIT`]. Lines long-running commands print along the way
//! (`serve`'s banner, `link-emu`, the demo) go through [`note`]: they
//! keep running when nobody reads them.

use std::fmt;
use std::io::{ErrorKind, Write};

/// Exit status when stdout was closed before everything was printed: 128 +
/// SIGPIPE, what a shell reports for a command a closed pipe stopped.
pub const CLOSED_EXIT: i32 = 141;

/// Stdout was closed by its reader.
#[derive(Debug)]
pub struct StdoutClosed;

impl fmt::Display for StdoutClosed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("stdout was closed")
    }
}

impl std::error::Error for StdoutClosed {}

/// Writes `args` to `w` and flushes; a broken pipe is [`StdoutClosed`],
/// any other failure says it was writing to stdout.
///
/// # Errors
/// As above.
pub fn write_to(w: &mut impl Write, args: fmt::Arguments<'_>) -> anyhow::Result<()> {
    match w.write_fmt(args).and_then(|()| w.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::BrokenPipe => Err(StdoutClosed.into()),
        Err(e) => Err(anyhow::Error::new(e).context("writing to stdout")),
    }
}

/// Prints `args` to stdout.
///
/// # Errors
/// [`StdoutClosed`] when the reader went away; other write errors.
pub fn print(args: fmt::Arguments<'_>) -> anyhow::Result<()> {
    write_to(&mut std::io::stdout().lock(), args)
}

/// Prints `args` to stdout if anyone reads it; errors are ignored.
pub fn note(args: fmt::Arguments<'_>) {
    let _ = print(args);
}

/// True if `e` (or an error it wraps) is [`StdoutClosed`].
pub fn is_closed(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.is::<StdoutClosed>())
}

/// `println!` for a command's result: evaluates to `anyhow::Result<()>`,
/// an error when stdout is closed ([`print`]).
#[macro_export]
macro_rules! outln {
    () => {
        $crate::out::print(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::out::print(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `println!` for lines along the way of a long-running command: a closed
/// stdout is ignored ([`note`]).
#[macro_export]
macro_rules! noteln {
    ($($arg:tt)*) => {
        $crate::out::note(format_args!("{}\n", format_args!($($arg)*)))
    };
}

pub use crate::{noteln, outln};

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A writer whose reader went away.
    struct Closed;

    impl Write for Closed {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            Err(ErrorKind::BrokenPipe.into())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_closed_stdout_is_its_own_error_and_survives_context() {
        let e = write_to(&mut Closed, format_args!("x\n")).unwrap_err();
        assert!(is_closed(&e), "{e:#}");
        let e = e.context("printing the status");
        assert!(is_closed(&e), "{e:#}");
        let mut buf = Vec::new();
        write_to(&mut buf, format_args!("a {}\n", 1)).unwrap();
        assert_eq!(buf, b"a 1\n");
        assert!(!is_closed(&anyhow::anyhow!("other")));
    }
}
