//! Parsing and formatting of the units used on the command line and in
//! config files: rates in bit/s (decimal SI, as link rates are quoted) and
//! sizes in bytes (SI and IEC prefixes).

/// Smallest and largest rate accepted anywhere (link rates, rate caps),
/// bit/s: 1 kbit/s and 10 Tbit/s.
pub const RATE_RANGE: (u64, u64) = (1_000, 10_000_000_000_000);

/// Parses a rate like `"1Gbit/s"`, `"250Mbit/s"`, `"800kbit/s"`,
/// `"1Tbit/s"` or a bare number of bit/s into bit/s (decimal SI prefixes,
/// as link rates are quoted), within [`RATE_RANGE`].
///
/// # Errors
/// A message naming the bad value: not a number with one of those units,
/// or outside the range.
pub fn parse_rate(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let bad = || format!("{s:?} is not a rate like \"1Gbit/s\" or \"250Mbit/s\"");
    let (num, mult) = if let Some(n) = t.strip_suffix("Tbit/s") {
        (n, 1e12)
    } else if let Some(n) = t.strip_suffix("Gbit/s") {
        (n, 1e9)
    } else if let Some(n) = t.strip_suffix("Mbit/s") {
        (n, 1e6)
    } else if let Some(n) = t.strip_suffix("kbit/s") {
        (n, 1e3)
    } else if let Some(n) = t.strip_suffix("bit/s") {
        (n, 1.0)
    } else {
        (t, 1.0)
    };
    let v: f64 = num.trim().parse().map_err(|_| bad())?;
    if !v.is_finite() {
        return Err(bad());
    }
    let r = v * mult;
    if !(RATE_RANGE.0 as f64..=RATE_RANGE.1 as f64).contains(&r) {
        return Err(format!("{s:?} is outside 1kbit/s..10Tbit/s"));
    }
    Ok(r as u64)
}

/// Formats bit/s the way [`parse_rate`] reads them, e.g. `"1Gbit/s"`,
/// `"250Mbit/s"`, `"5kbit/s"`.
pub fn format_rate(bps: u64) -> String {
    let (v, unit) = if bps >= 1_000_000_000_000 {
        (bps as f64 / 1e12, "Tbit/s")
    } else if bps >= 1_000_000_000 {
        (bps as f64 / 1e9, "Gbit/s")
    } else if bps >= 1_000_000 {
        (bps as f64 / 1e6, "Mbit/s")
    } else if bps >= 1_000 {
        (bps as f64 / 1e3, "kbit/s")
    } else {
        (bps as f64, "bit/s")
    };
    let text = format!("{v:.3}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    format!("{text}{unit}")
}

/// Parses a size in bytes: a non-negative decimal number with an optional
/// unit, e.g. `"1000"`, `"20MB"`, `"1.4GB"`, `"512KiB"`, `"2 GiB"`.
///
/// Units (case-insensitive): `B`; decimal SI `kB`, `MB`, `GB`, `TB`, `PB`
/// (powers of 1000); binary IEC `KiB`, `MiB`, `GiB`, `TiB`, `PiB` (powers
/// of 1024). Single letters such as `M` are rejected as ambiguous.
///
/// # Errors
///
/// A message naming the bad value for an empty or malformed number, an
/// unknown unit, a result that is not a whole number of bytes (e.g.
/// `"1.5B"`) or one that exceeds `u64::MAX` bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let text = s.trim();
    let num_end = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(num_end);
    let unit = unit.trim_start();
    let multiplier: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "pb" => 1_000_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        "pib" => 1 << 50,
        _ => {
            return Err(format!(
                "invalid size {s:?}: unknown unit {unit:?} \
                 (use B, kB, MB, GB, TB, PB, KiB, MiB, GiB, TiB or PiB)"
            ))
        }
    };
    let (int_part, frac_part) = number.split_once('.').unwrap_or((number, ""));
    let all_digits = |p: &str| p.bytes().all(|b| b.is_ascii_digit());
    if int_part.is_empty() && frac_part.is_empty()
        || !all_digits(int_part)
        || !all_digits(frac_part)
    {
        return Err(format!(
            "invalid size {s:?}: expected a number such as 20MB, 1.4GB or 512KiB"
        ));
    }
    let too_large = || format!("invalid size {s:?}: larger than {} bytes", u64::MAX);
    // Exact decimal arithmetic: value = digits / 10^frac_len * multiplier.
    let mut digits: u128 = 0;
    for b in int_part.bytes().chain(frac_part.bytes()) {
        digits = digits
            .checked_mul(10)
            .and_then(|d| d.checked_add(u128::from(b - b'0')))
            .ok_or_else(too_large)?;
    }
    let scale = u32::try_from(frac_part.len())
        .ok()
        .and_then(|n| 10u128.checked_pow(n))
        .ok_or_else(too_large)?;
    let scaled = digits
        .checked_mul(u128::from(multiplier))
        .ok_or_else(too_large)?;
    if scaled % scale != 0 {
        return Err(format!("invalid size {s:?}: not a whole number of bytes"));
    }
    u64::try_from(scaled / scale).map_err(|_| too_large())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn parse_size_accepts_si_and_iec_units() {
        let ok = [
            ("1000", 1000),
            ("0", 0),
            ("1.4GB", 1_400_000_000),
            ("20MB", 20_000_000),
            ("512KiB", 512 * 1024),
            ("2 GiB", 2 << 30),
            (" 1.5KiB ", 1536),
            ("7B", 7),
            ("3kB", 3000),
            ("1tb", 1_000_000_000_000),
            ("1TiB", 1 << 40),
            ("1PB", 1_000_000_000_000_000),
            ("1.25MiB", 1_310_720),
            (".5kB", 500),
            ("10.MB", 10_000_000),
            ("18446744073709551615", u64::MAX),
        ];
        for (s, want) in ok {
            assert_eq!(parse_size(s), Ok(want), "{s:?}");
        }
    }

    #[test]
    fn parse_size_errors_name_the_value() {
        for bad in [
            "",
            "GB",
            "abc",
            "-5",
            "+5",
            "1.2.3MB",
            "5XB",
            "20M",
            "1e9",
            "1.5",
            "0.1B",
            "18446744073709551616",
            "99999999999999999999999PB",
            ".",
        ] {
            let err = parse_size(bad).unwrap_err();
            assert!(err.contains(&format!("{bad:?}")), "{bad:?}: {err}");
        }
    }
}
