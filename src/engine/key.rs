//! Store keys: `<prefix>:<layer>:<domain>:<algorithm>:<period>[~<variant>]:<k>=<v>:<k>=<v>...`.
//!
//! Every component is escaped, so the encoding is injective (`a=b:c` and `a=b`,`c` differ) and
//! no value can place a `{...}` Redis Cluster hash tag in the key.
//!
//! The entries part (`:<k>=<v>:<k>=<v>...`, escaped) is kept as it is up to
//! [`MAX_PLAIN_ENTRIES_BYTES`]; a longer one is replaced by `:sha256-<64 hex digits>`, the SHA-256
//! of exactly those bytes, so a key's length never grows with the length of a request's values.
//!
//! Why this stays injective:
//! - The components before the entries hold no `:` (prefix, layer and domain are escaped; the
//!   algorithm tag and the period are fixed words and decimals), so splitting a key on `:` finds
//!   them first and the entries after them, one segment each.
//! - A plain entry segment is `<k>=<v>` with `=` escaped inside `k` and `v`: it always holds
//!   exactly one `=`. The digest segment (`sha256-` and hex digits) holds none. So a digested key
//!   never equals a plain key, whatever the entries.
//! - Whether a key is digested depends only on the escaped entries' length, and two digested keys
//!   with the same head are equal only if the SHA-256 of their escaped entries are, which (the
//!   escaping being injective) means the same entries unless SHA-256 collides.
//! - Neither form holds a brace, so Redis Cluster still hashes the whole key to pick its slot.

use std::borrow::Cow;

use ring::digest::{Context, SHA256};

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
        let unescaped: usize = entries.iter().map(|(k, v)| k.len() + v.len() + 2).sum();
        // Escaping only lengthens, so entries this long are digested whatever they hold.
        let long = unescaped > MAX_PLAIN_ENTRIES_BYTES;
        let mut key = String::with_capacity(
            self.prefix.len()
                + self.domain.len()
                + 32
                + if long {
                    DIGEST_SEGMENT_BYTES
                } else {
                    unescaped
                },
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
        if long {
            let mut digest = Context::new(&SHA256);
            for_each_entries_piece(entries, |piece| digest.update(piece.as_bytes()));
            push_digest(&mut key, digest);
            return key;
        }
        let start = key.len();
        for_each_entries_piece(entries, |piece| key.push_str(piece));
        if key.len() - start > MAX_PLAIN_ENTRIES_BYTES {
            // Short entries that escaping lengthened past the bound: rare, so hashed afterwards.
            let mut digest = Context::new(&SHA256);
            digest.update(&key.as_bytes()[start..]);
            key.truncate(start);
            push_digest(&mut key, digest);
        }
        key
    }
}

/// Longest escaped entries part (`:<k>=<v>...`) kept readable in a key; a longer one is replaced
/// by its digest. Room for the usual descriptors (an IPv6 `remote_address`, an API key, a path
/// of a few segments) while bounding every key.
pub const MAX_PLAIN_ENTRIES_BYTES: usize = 96;

/// What stands before the digest's hex digits: no `=`, unlike every plain entry segment.
const DIGEST_MARKER: &str = ":sha256-";

/// Length of the digest segment: the marker and 32 bytes in hex.
pub const DIGEST_SEGMENT_BYTES: usize = DIGEST_MARKER.len() + 64;

/// Feeds the escaped entries part (`:<k>=<v>:<k>=<v>...`) to `sink` piece by piece, so it can be
/// appended to a key or hashed without first being built.
fn for_each_entries_piece(entries: &[(String, String)], mut sink: impl FnMut(&str)) {
    for (k, v) in entries {
        sink(":");
        escape_with(k, &mut sink);
        sink("=");
        escape_with(v, &mut sink);
    }
}

/// Appends the digest segment of what `digest` was fed.
fn push_digest(key: &mut String, digest: Context) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    key.push_str(DIGEST_MARKER);
    for byte in digest.finish().as_ref() {
        key.push(char::from(HEX[usize::from(byte >> 4)]));
        key.push(char::from(HEX[usize::from(byte & 0xf)]));
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
    escape_with(text, |piece| out.push_str(piece));
}

/// Feeds `text`, escaped as [`escape_into`] appends it, to `sink` in pieces.
fn escape_with(text: &str, mut sink: impl FnMut(&str)) {
    // All five are ASCII, so a byte scan finds them; most values have none and go in one piece.
    if !needs_escape(text) {
        sink(text);
        return;
    }
    let mut plain = 0;
    for (at, byte) in text.bytes().enumerate() {
        let escaped = match byte {
            b'%' => "%25",
            b':' => "%3A",
            b'=' => "%3D",
            b'{' => "%7B",
            b'}' => "%7D",
            _ => continue,
        };
        // An ASCII byte never sits inside a multi-byte character, so both cuts are boundaries.
        sink(&text[plain..at]);
        sink(escaped);
        plain = at + 1;
    }
    sink(&text[plain..]);
}

/// Appends `n` in decimal: `write!` costs several times more on these per-check paths, and
/// itoa's two digits per step half as much as a digit at a time.
pub(crate) fn push_decimal(out: &mut String, n: u64) {
    out.push_str(itoa::Buffer::new().format(n));
}

#[cfg(test)]
mod tests {
    use ring::digest::{SHA256, digest};

    use super::{DIGEST_SEGMENT_BYTES, MAX_PLAIN_ENTRIES_BYTES, encode, push_decimal};
    use crate::engine::KeySettings;
    use crate::limit::{Limit, Unit};

    /// The key of a one-minute fixed window in domain `d` for `entries`.
    fn key(entries: &[(&str, &str)]) -> String {
        let entries: Vec<(String, String)> = entries
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        encode(
            &KeySettings::default(),
            "_",
            "d",
            &Limit::fixed(1, Unit::Minute),
            &entries,
        )
    }

    const HEAD: &str = "rlsd:_:d:fw:60";

    /// The digest segment of an escaped entries part, computed here independently of `encode`.
    fn digested(escaped_entries: &str) -> String {
        let hex: String = digest(&SHA256, escaped_entries.as_bytes())
            .as_ref()
            .iter()
            .map(|byte| format!("{byte:02x}"))
            .collect();
        format!("{HEAD}:sha256-{hex}")
    }

    #[test]
    fn usual_keys_stay_readable_and_unchanged() {
        assert_eq!(
            key(&[("remote_address", "2001:db8:85a3::8a2e:370:7334")]),
            "rlsd:_:d:fw:60:remote_address=2001%3Adb8%3A85a3%3A%3A8a2e%3A370%3A7334"
        );
        assert_eq!(
            key(&[
                ("plan", "pro"),
                ("api_key", "k-0123456789abcdef0123456789abcdef")
            ]),
            "rlsd:_:d:fw:60:plan=pro:api_key=k-0123456789abcdef0123456789abcdef"
        );
        assert_eq!(key(&[]), HEAD);
    }

    #[test]
    fn entries_at_the_bound_stay_plain_and_one_byte_over_are_digested() {
        // `:k=` and 93 bytes: exactly the bound.
        let at = "a".repeat(MAX_PLAIN_ENTRIES_BYTES - 3);
        assert_eq!(key(&[("k", &at)]), format!("{HEAD}:k={at}"));
        // One more byte: the digest of `:k=` and 94 `a`s, as `sha256sum` prints it.
        let over = "a".repeat(MAX_PLAIN_ENTRIES_BYTES - 2);
        assert_eq!(
            key(&[("k", &over)]),
            format!(
                "{HEAD}:sha256-a57e1dbf8910929505ecb211202f42c4e14cce32ff8dd16de5c3201609354a47"
            )
        );
        assert_eq!(digested(&format!(":k={over}")), key(&[("k", &over)]));
    }

    #[test]
    fn the_bound_counts_escaped_bytes() {
        // 31 colons escape to 93 bytes: `:k=` and them is exactly the bound, though 34 unescaped.
        let at = ":".repeat(31);
        assert_eq!(key(&[("k", &at)]), format!("{HEAD}:k={}", "%3A".repeat(31)));
        // One byte more, escaped or not, goes over it.
        for over in [format!("{at}a"), ":".repeat(32)] {
            let escaped = format!(":k={}", over.replace(':', "%3A"));
            assert!(escaped.len() > MAX_PLAIN_ENTRIES_BYTES);
            assert_eq!(key(&[("k", &over)]), digested(&escaped), "{over}");
        }
        // Escaping within a long value is hashed piece by piece as it would have been written.
        let long = format!("{}{{tag}}=%{}", "x".repeat(100), "é".repeat(10));
        let escaped = format!(":k%3D={}%7Btag%7D%3D%25{}", "x".repeat(100), "é".repeat(10));
        assert_eq!(key(&[("k=", &long)]), digested(&escaped));
    }

    #[test]
    fn keys_are_bounded_whatever_the_entries() {
        let value = "v".repeat(16 * 1024);
        let many: Vec<(&str, &str)> = (0..32).map(|_| ("k", value.as_str())).collect();
        for entries in [&many[..1], &many[..]] {
            let key = key(entries);
            assert_eq!(key.len(), HEAD.len() + DIGEST_SEGMENT_BYTES, "{key}");
            assert!(!key.contains('{') && !key.contains('}'), "{key}");
        }
    }

    #[test]
    fn digested_keys_never_equal_plain_ones_nor_each_other() {
        let a = "a".repeat(200);
        let b = "b".repeat(200);
        let long_ab = key(&[("k", &a), ("j", &b)]);
        let keys = [
            long_ab.clone(),
            key(&[("k", &format!("{a}:j={b}"))]),
            key(&[("k", &a), ("j", &format!("{b}x"))]),
            key(&[("j", &b), ("k", &a)]),
            key(&[("k", &a)]),
        ];
        for (i, x) in keys.iter().enumerate() {
            assert!(x.starts_with(&format!("{HEAD}:sha256-")), "{x}");
            for y in &keys[i + 1..] {
                assert_ne!(x, y);
            }
        }
        // A plain entry spelled like a digest keeps its `=`, so it cannot meet one.
        let segment = &long_ab[HEAD.len() + 1..];
        let lookalike = key(&[(segment, "")]);
        assert_eq!(lookalike, format!("{long_ab}="));
        assert_ne!(lookalike, long_ab);
        // The digest segment holds no `=`; every plain entry segment holds exactly one.
        assert!(!segment.contains('='));
        assert_eq!(key(&[("k", &a)]), key(&[("k", &a)]));
    }

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
