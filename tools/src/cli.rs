//! What the command lines of kungfu-bench, kungfu-sim and kungfu-selftest
//! share (they parse with clap; kungfu-run keeps its mpirun-style parser in
//! [`crate::options`]): value parsers for the forms they all accept, and
//! `--completions`.

use std::convert::Infallible;
use std::fmt::Display;

use clap::CommandFactory;
use clap_complete::aot::{generate, Shell};

/// A value parser for `A,B,...`: each part trimmed and parsed by `each`;
/// empty parts are skipped (`4,16,` is `4,16`). The whole list is one
/// value, so a flag given twice keeps its last list, as every other flag:
/// the field is spelled `std::vec::Vec<T>`, which keeps clap's derive from
/// taking a `Vec` for a flag that repeats.
pub fn list<T, E: Display>(
    each: impl Fn(&str) -> Result<T, E> + Clone + Send + Sync + 'static,
) -> impl Fn(&str) -> Result<Vec<T>, String> + Clone + Send + Sync + 'static {
    move |s| {
        s.split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(|p| each(p).map_err(|e| format!("{p:?}: {e}")))
            .collect()
    }
}

/// A value parser for a count of at least `min`.
pub fn at_least(
    min: usize,
) -> impl Fn(&str) -> Result<usize, String> + Clone + Send + Sync + 'static {
    move |s| match s.parse::<usize>() {
        Ok(n) if n >= min => Ok(n),
        Ok(_) => Err(format!("must be at least {min}")),
        Err(e) => Err(e.to_string()),
    }
}

/// A value parser for the nccl-tests switches `0|1`: anything but `0` is on.
pub fn on_off(s: &str) -> Result<bool, Infallible> {
    Ok(s != "0")
}

/// Writes `C`'s completion script for `shell` to stdout.
pub fn print_completions<C: CommandFactory>(shell: Shell) {
    let mut cmd = C::command();
    let name = cmd.get_name().to_string();
    generate(shell, &mut cmd, name, &mut std::io::stdout());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_lists_skip_empty_parts_and_name_a_bad_one() {
        let sizes = list(at_least(1));
        assert_eq!(sizes(" 4, 16,,64,"), Ok(vec![4, 16, 64]));
        assert_eq!(sizes(""), Ok(vec![]));
        assert_eq!(sizes("4,0").unwrap_err(), "\"0\": must be at least 1");
        assert!(sizes("4,x")
            .unwrap_err()
            .starts_with("\"x\": invalid digit"));
    }

    #[test]
    fn cli_switches_are_on_unless_zero() {
        assert_eq!(on_off("0"), Ok(false));
        assert_eq!(on_off("1"), Ok(true));
        assert_eq!(on_off("yes"), Ok(true));
    }
}
