//! The `ferry` command.

// Not wired into the CLI yet (`ferry gen` comes later); tested in place.
#[allow(dead_code)]
mod gen;

fn main() {}
