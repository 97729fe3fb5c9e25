//! Store keys: `<prefix>:<layer>:<domain>:<algorithm>:<period>[~<variant>]:<k>=<v>:<k>=<v>...`.
//!
//! Every component is escaped, so the encoding is injective (`a=b:c` and `a=b`,`c` differ) and
//! no value can place a `{...}` Redis Cluster hash tag in the key.

use std::borrow::Cow;

use crate::limit::Limit;

use super::KeySettings;

/// Builds the key of `limit` for a descriptor with `entries`.
pub fn encode(
    settings: &KeySettings,
    layer: &str,
    domain: &str,
    limit: &Limit,
    entries: &[(String, String)],
) -> String {
    Namespace::new(settings, domain).encode(layer, limit, entries)
}

/// The prefix and domain every key of one request shares, escaped once for the request rather
/// than once per key (both almost never need escaping, so both are usually borrowed).
pub struct Namespace<'a> {
    prefix: Cow<'a, str>,
    domain: Cow<'a, str>,
}

impl<'a> Namespace<'a> {
    /// The namespace of a request to `domain`.
    pub fn new(settings: &'a KeySettings, domain: &'a str) -> Self {
        Namespace {
            prefix: escaped(&settings.prefix),
            domain: escaped(domain),
        }
    }

    /// Builds the key of `limit` for a descriptor with `entries`.
    pub fn encode(&self, layer: &str, limit: &Limit, entries: &[(String, String)]) -> String {
        let mut key = String::with_capacity(
            self.prefix.len()
                + self.domain.len()
                + 32
                + entries
                    .iter()
                    .map(|(k, v)| k.len() + v.len() + 2)
                    .sum::<usize>(),
        );
        key.push_str(&self.prefix);
        key.push(':');
        escape_into(&mut key, layer);
        key.push(':');
        key.push_str(&self.domain);
        key.push(':');
        key.push_str(limit.algorithm.key_tag());
        key.push(':');
        push_decimal(&mut key, limit.period.seconds());
        if limit.variant > 0 {
            key.push('~');
            push_decimal(&mut key, u64::from(limit.variant));
        }
        for (k, v) in entries {
            key.push(':');
            escape_into(&mut key, k);
            key.push('=');
            escape_into(&mut key, v);
        }
        key
    }
}

fn escaped(text: &str) -> Cow<'_, str> {
    if needs_escape(text) {
        let mut out = String::with_capacity(text.len() + 8);
        escape_into(&mut out, text);
        Cow::Owned(out)
    } else {
        Cow::Borrowed(text)
    }
}

/// The bytes `escape_into` encodes, as a table: one load per byte instead of five comparisons.
static NEEDS_ESCAPE: [bool; 256] = {
    let mut table = [false; 256];
    table[b'%' as usize] = true;
    table[b':' as usize] = true;
    table[b'=' as usize] = true;
    table[b'{' as usize] = true;
    table[b'}' as usize] = true;
    table
};

fn needs_escape(text: &str) -> bool {
    text.bytes().any(|b| NEEDS_ESCAPE[usize::from(b)])
}

/// Appends `text` with the separators, the escape character and hash-tag braces percent-encoded.
fn escape_into(out: &mut String, text: &str) {
    // All five are ASCII, so a byte scan finds them; most values have none and copy in one go.
    if !needs_escape(text) {
        out.push_str(text);
        return;
    }
    for c in text.chars() {
        match c {
            '%' => out.push_str("%25"),
            ':' => out.push_str("%3A"),
            '=' => out.push_str("%3D"),
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            c => out.push(c),
        }
    }
}

/// Appends `n` in decimal: `write!` costs several times more on these per-check paths, and
/// itoa's two digits per step half as much as a digit at a time.
pub(crate) fn push_decimal(out: &mut String, n: u64) {
    out.push_str(itoa::Buffer::new().format(n));
}

#[cfg(test)]
mod tests {
    use super::push_decimal;

    #[test]
    fn decimals_match_display() {
        for n in [
            0,
            7,
            9,
            10,
            60,
            86_400,
            31_536_000,
            999_999_999_999,
            u64::MAX,
        ] {
            let mut out = String::from("x");
            push_decimal(&mut out, n);
            assert_eq!(out, format!("x{n}"));
        }
    }
}
