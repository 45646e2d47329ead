//! Random values from the sandbox's secure random source (`wasi:random`).
//!
//! Generate secrets only when they are absent from what was observed, and read them back
//! from the observed object ever after: reconcile runs many times.

/// `n` random bytes. Fails only if the host provides no random source.
pub fn bytes(n: usize) -> Result<Vec<u8>, crate::Error> {
    let mut buf = vec![0u8; n];
    getrandom::fill(&mut buf).map_err(|e| crate::Error::retry(format!("no random source: {e}")))?;
    Ok(buf)
}

/// A random v4 UUID in its hyphenated lower-case form.
pub fn uuid_v4() -> Result<String, crate::Error> {
    let mut b = bytes(16)?;
    b[6] = (b[6] & 0x0f) | 0x40; // version 4
    b[8] = (b[8] & 0x3f) | 0x80; // RFC 4122 variant
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    Ok(format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    ))
}

/// A random string of `len` characters from `[A-Za-z0-9]`, for passwords. Uses
/// rejection sampling so that every character is equally likely.
pub fn alphanumeric(len: usize) -> Result<String, crate::Error> {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut out = String::with_capacity(len);
    while out.len() < len {
        for b in bytes(len * 2)? {
            // 248 = 4 * 62: bytes at or above it would bias the first characters.
            if b < 248 && out.len() < len {
                out.push(ALPHABET[(b % 62) as usize] as char);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_has_version_4_and_the_rfc_variant() {
        let u = uuid_v4().unwrap();
        assert_eq!(u.len(), 36);
        assert_eq!(&u[14..15], "4");
        assert!(matches!(&u[19..20], "8" | "9" | "a" | "b"), "{u}");
        assert_ne!(u, uuid_v4().unwrap());
    }

    #[test]
    fn alphanumeric_has_the_length_and_alphabet() {
        let p = alphanumeric(32).unwrap();
        assert_eq!(p.len(), 32);
        assert!(p.bytes().all(|b| b.is_ascii_alphanumeric()));
    }
}
