//! Validation of `spec.backupSchedule`: the cron syntax a Kubernetes CronJob accepts.
//!
//! Five fields (minute, hour, day of month, month, day of week), each a `,` list of
//! `*`, a number, a range `a-b`, optionally with a step `/n` (`*/15`, `1-30/2`, `5/10`);
//! months and days of week may be named (`jan`, `mon`); `?` stands for `*` in the two
//! day fields. Or one of the macros `@yearly`, `@annually`, `@monthly`, `@weekly`,
//! `@daily`, `@midnight`, `@hourly` (lower-case). Day of week is 0-6 (7 is refused, as
//! Kubernetes does). `@every` and `CRON_TZ=` are not accepted. Where this is stricter
//! than Kubernetes (a step larger than its field, an empty list item, `?` outside the day
//! fields) it refuses what is surely a mistake; it never accepts what Kubernetes refuses.

/// One field of a cron expression: its name, its bounds and its optional names.
struct Field {
    name: &'static str,
    min: u32,
    max: u32,
    names: &'static [&'static str],
}

const FIELDS: [Field; 5] = [
    Field {
        name: "minute",
        min: 0,
        max: 59,
        names: &[],
    },
    Field {
        name: "hour",
        min: 0,
        max: 23,
        names: &[],
    },
    Field {
        name: "day of month",
        min: 1,
        max: 31,
        names: &[],
    },
    Field {
        name: "month",
        min: 1,
        max: 12,
        names: &[
            "jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec",
        ],
    },
    // 0-6 from Sunday: the Go cron parser Kubernetes uses refuses 7.
    Field {
        name: "day of week",
        min: 0,
        max: 6,
        names: &["sun", "mon", "tue", "wed", "thu", "fri", "sat"],
    },
];

const MACROS: [&str; 7] = [
    "@yearly",
    "@annually",
    "@monthly",
    "@weekly",
    "@daily",
    "@midnight",
    "@hourly",
];

/// Checks a cron expression; the error says which field is wrong and why, in one line.
pub fn validate(expression: &str) -> Result<(), String> {
    let expression = expression.trim();
    if expression.starts_with('@') {
        // Case-sensitive, as Kubernetes' parser is: `@Daily` is refused there.
        return if MACROS.contains(&expression) {
            Ok(())
        } else {
            Err(format!(
                "{expression:?} is not a known macro (use one of {})",
                MACROS.join(", ")
            ))
        };
    }
    let parts: Vec<&str> = expression.split_whitespace().collect();
    if parts.len() != FIELDS.len() {
        return Err(format!(
            "{expression:?} has {} fields; expected 5 (minute hour day-of-month month day-of-week) or a macro such as @daily",
            parts.len()
        ));
    }
    for (part, field) in parts.iter().zip(&FIELDS) {
        check_field(part, field).map_err(|why| format!("{} field {part:?}: {why}", field.name))?;
    }
    Ok(())
}

fn check_field(text: &str, field: &Field) -> Result<(), String> {
    for item in text.split(',') {
        check_item(item, field)?;
    }
    Ok(())
}

/// One list item: `*`, `?`, `a`, `a-b`, each optionally followed by `/step`.
fn check_item(item: &str, field: &Field) -> Result<(), String> {
    if item.is_empty() {
        return Err("empty list item".into());
    }
    let (range, step) = match item.split_once('/') {
        Some((range, step)) => (range, Some(step)),
        None => (item, None),
    };
    if let Some(step) = step {
        let step: u32 = step
            .parse()
            .map_err(|_| format!("step {step:?} is not a number"))?;
        if step == 0 || step > field.max {
            return Err(format!("step {step} must be between 1 and {}", field.max));
        }
    }
    let day_field = matches!(field.name, "day of month" | "day of week");
    if range == "*" || (range == "?" && day_field) {
        return Ok(());
    }
    match range.split_once('-') {
        Some((low, high)) => {
            let (low, high) = (value(low, field)?, value(high, field)?);
            if low > high {
                return Err(format!("range {low}-{high} goes backwards"));
            }
        }
        None => {
            value(range, field)?;
        }
    }
    Ok(())
}

/// A number or a name, within the field's bounds.
fn value(text: &str, field: &Field) -> Result<u32, String> {
    let lower = text.to_ascii_lowercase();
    if let Some(i) = field.names.iter().position(|n| *n == lower) {
        // Names of months start at 1, names of days of the week at 0.
        return Ok(field.min + i as u32);
    }
    let n: u32 = text.parse().map_err(|_| {
        if field.names.is_empty() {
            format!("{text:?} is not a number")
        } else {
            format!(
                "{text:?} is neither a number nor a name such as {:?}",
                field.names[0]
            )
        }
    })?;
    if n < field.min || n > field.max {
        return Err(format!("{n} is out of range {}-{}", field.min, field.max));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::validate;

    #[test]
    fn accepts_what_a_cronjob_accepts() {
        for ok in [
            "0 2 * * *",
            "*/15 * * * *",
            "0 0 1 1 *",
            "5,35 1-5 * * mon-fri",
            "0 3 * JAN,jul SUN",
            "0 0 ? * 6",
            "0 0 * * ?",
            "1-30/2 5/3 1-31 1-12 0-6",
            "59 23 31 12 6",
            "  0 2 * * *  ",
            "@daily",
            "@hourly",
            "@weekly",
            "@monthly",
            "@yearly",
            "@annually",
            "@midnight",
        ] {
            assert_eq!(validate(ok), Ok(()), "{ok}");
        }
    }

    #[test]
    fn refuses_with_the_field_and_the_reason() {
        for (bad, why) in [
            ("", "has 0 fields"),
            ("0 2 * *", "has 4 fields"),
            ("0 2 * * * *", "has 6 fields"),
            ("60 * * * *", "minute field \"60\": 60 is out of range 0-59"),
            ("* 24 * * *", "hour field \"24\": 24 is out of range 0-23"),
            (
                "* * 0 * *",
                "day of month field \"0\": 0 is out of range 1-31",
            ),
            ("* * * 13 *", "month field \"13\": 13 is out of range 1-12"),
            (
                "* * * * 7",
                "day of week field \"7\": 7 is out of range 0-6",
            ),
            (
                "* * * foo *",
                "month field \"foo\": \"foo\" is neither a number nor a name",
            ),
            ("*/0 * * * *", "step 0 must be between 1 and 59"),
            ("*/x * * * *", "step \"x\" is not a number"),
            ("5-1 * * * *", "range 5-1 goes backwards"),
            ("1,,2 * * * *", "empty list item"),
            ("? * * * *", "minute field \"?\": \"?\" is not a number"),
            ("a * * * *", "\"a\" is not a number"),
            ("-1 * * * *", "\"\" is not a number"),
            ("@every 1h", "is not a known macro"),
            ("@reboot", "is not a known macro"),
            ("@Daily", "is not a known macro"),
            ("CRON_TZ=UTC 0 2 * * *", "has 6 fields"),
        ] {
            let err = validate(bad).expect_err(bad);
            assert!(err.contains(why), "{bad:?}: {err:?} should contain {why:?}");
            assert!(!err.contains('\n'), "{err}");
        }
    }
}
