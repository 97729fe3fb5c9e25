//! Store keys: `<prefix>:<layer>:<domain>:<algorithm>:<period>[~<variant>]:<k>=<v>:<k>=<v>...`.
//!
//! Every component is escaped, so the encoding is injective (`a=b:c` and `a=b`,`c` differ) and
//! no value can place a `{...}` Redis Cluster hash tag in the key.

use std::fmt::Write;

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
    let mut key = String::with_capacity(
        settings.prefix.len()
            + domain.len()
            + 32
            + entries
                .iter()
                .map(|(k, v)| k.len() + v.len() + 2)
                .sum::<usize>(),
    );
    escape_into(&mut key, &settings.prefix);
    key.push(':');
    escape_into(&mut key, layer);
    key.push(':');
    escape_into(&mut key, domain);
    // Writing to a String cannot fail.
    let _ = write!(
        key,
        ":{}:{}",
        limit.algorithm.key_tag(),
        limit.period.seconds()
    );
    if limit.variant > 0 {
        let _ = write!(key, "~{}", limit.variant);
    }
    for (k, v) in entries {
        key.push(':');
        escape_into(&mut key, k);
        key.push('=');
        escape_into(&mut key, v);
    }
    key
}

/// Appends `text` with the separators, the escape character and hash-tag braces percent-encoded.
fn escape_into(out: &mut String, text: &str) {
    // All five are ASCII, so a byte scan finds them; most values have none and copy in one go.
    if !text
        .bytes()
        .any(|b| matches!(b, b'%' | b':' | b'=' | b'{' | b'}'))
    {
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
