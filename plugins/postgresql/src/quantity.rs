//! Storage sizes as Kubernetes quantities (`10Gi`, `500M`, `1.5Ti`, `1e9`), parsed exactly
//! so that two spellings of one size (`10Gi`, `10240Mi`) compare equal: the API server
//! rewrites quantities into a canonical form, so the text alone cannot tell a change.

use std::cmp::Ordering;

/// A positive size in bytes, as the exact fraction `numerator / denominator`, compared
/// exactly: `1Gi` > `1G` > `500Mi`.
#[derive(Debug, Clone, Copy)]
pub struct Quantity {
    numerator: u128,
    denominator: u128,
}

impl Ord for Quantity {
    fn cmp(&self, other: &Self) -> Ordering {
        // a/b vs c/d  <=>  a*d vs c*b: both parts are below 2^64 (checked when parsed),
        // so the products cannot overflow.
        (self.numerator * other.denominator).cmp(&(other.numerator * self.denominator))
    }
}

impl PartialOrd for Quantity {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Quantity {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Quantity {}

/// Largest number of significant digits accepted, which keeps the arithmetic in `u128`.
const MAX_DIGITS: usize = 18;

impl Quantity {
    /// Parses a quantity; the error is one line saying what is wrong.
    pub fn parse(text: &str) -> Result<Self, String> {
        let split = text
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(text.len());
        let (number, suffix) = text.split_at(split);
        let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
        if whole.is_empty() && fraction.is_empty() {
            return Err(format!(
                "{text:?} is not a quantity: expected a number with an optional suffix such as Gi"
            ));
        }
        let digits = format!("{whole}{fraction}");
        let digits = digits.trim_start_matches('0');
        if digits.len() > MAX_DIGITS {
            return Err(format!("{text:?} has too many digits"));
        }
        let mantissa: u128 = if digits.is_empty() {
            0
        } else {
            digits
                .parse()
                .map_err(|_| format!("{text:?} is not a quantity"))?
        };
        if mantissa == 0 {
            return Err(format!("{text:?} must be larger than zero"));
        }
        let (base, exponent) = multiplier(suffix).ok_or_else(|| {
            format!(
                "{text:?} has an unknown suffix {suffix:?} (use Ki, Mi, Gi, Ti, k, M, G, T, ...)"
            )
        })?;
        let mut q = Quantity {
            numerator: mantissa,
            denominator: 10u128.pow(fraction.len() as u32),
        };
        let factor = base
            .checked_pow(exponent.unsigned_abs())
            .ok_or_else(|| format!("{text:?} is too large"))?;
        if exponent >= 0 {
            q.numerator = q
                .numerator
                .checked_mul(factor)
                .ok_or_else(|| format!("{text:?} is too large"))?;
        } else {
            q.denominator = q
                .denominator
                .checked_mul(factor)
                .ok_or_else(|| format!("{text:?} is too small"))?;
        }
        // Both below 2^64, so comparing by cross-multiplication cannot overflow; that
        // still allows sizes up to 16 EiB.
        if q.numerator > u128::from(u64::MAX) || q.denominator > u128::from(u64::MAX) {
            return Err(format!("{text:?} is out of range"));
        }
        Ok(q)
    }
}

/// The multiplier of a suffix, as `base ^ exponent`.
fn multiplier(suffix: &str) -> Option<(u128, i32)> {
    Some(match suffix {
        "" => (10, 0),
        "Ki" => (1024, 1),
        "Mi" => (1024, 2),
        "Gi" => (1024, 3),
        "Ti" => (1024, 4),
        "Pi" => (1024, 5),
        "Ei" => (1024, 6),
        "m" => (10, -3),
        "k" => (10, 3),
        "M" => (10, 6),
        "G" => (10, 9),
        "T" => (10, 12),
        "P" => (10, 15),
        "E" => (10, 18),
        _ => {
            let exponent = suffix
                .strip_prefix('e')
                .or_else(|| suffix.strip_prefix('E'))?;
            let exponent: i32 = exponent.parse().ok()?;
            if exponent.unsigned_abs() > 30 {
                return None;
            }
            (10, exponent)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::Quantity;

    fn q(text: &str) -> Quantity {
        Quantity::parse(text).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn spellings_of_one_size_are_equal() {
        assert_eq!(q("10Gi"), q("10240Mi"));
        assert_eq!(q("1.5Gi"), q("1536Mi"));
        assert_eq!(q("1G"), q("1000M"));
        assert_eq!(q("0.1G"), q("100M"));
        assert_eq!(q("1e9"), q("1G"));
        assert_eq!(q("1E3"), q("1k"));
        assert_eq!(q("1024"), q("1Ki"));
        assert_eq!(q("1000m"), q("1"));
        assert_eq!(q("010Gi"), q("10Gi"));
    }

    #[test]
    fn different_sizes_differ() {
        assert_ne!(q("10Gi"), q("20Gi"));
        assert_ne!(q("1G"), q("1Gi"));
        assert_ne!(q("1.5Gi"), q("1.25Gi"));
    }

    #[test]
    fn sizes_are_ordered_across_suffixes() {
        assert!(q("500Mi") < q("1Gi"));
        assert!(q("1Gi") < q("2G"));
        assert!(q("1G") < q("1Gi"), "1e9 < 2^30");
        assert!(q("1Gi") > q("1000Mi"));
        assert!(q("1.5Gi") > q("1500M"));
        assert!(q("1Ei") > q("1E"));
        assert!(q("999m") < q("1"));
        assert_eq!(q("2G").cmp(&q("2000M")), std::cmp::Ordering::Equal);
    }

    #[test]
    fn invalid_quantities_are_one_line_errors() {
        for (bad, why) in [
            ("", "is not a quantity"),
            ("Gi", "is not a quantity"),
            ("ten", "is not a quantity"),
            ("10GB", "unknown suffix \"GB\""),
            ("10 Gi", "unknown suffix \" Gi\""),
            ("-1Gi", "is not a quantity"),
            ("0Gi", "larger than zero"),
            ("1.2.3Gi", "is not a quantity"),
            ("1e99", "unknown suffix"),
            ("9999999999999999999Ei", "too many digits"),
        ] {
            let err = Quantity::parse(bad).expect_err(bad);
            assert!(err.contains(why), "{bad:?}: {err:?} should contain {why:?}");
        }
    }
}
