//! A generic YAML tree where every node (map keys included) carries its line and column.
//!
//! serde-saphyr parses the text; [`Node`]'s own `Deserialize` impl accepts any scalar, sequence
//! or mapping and wraps each in [`serde_saphyr::Spanned`], so the loader can report every problem
//! of a file at the exact key or value it concerns, instead of stopping at the first. Plain
//! scalars are then typed from their spelling as envoyproxy/ratelimit's YAML library
//! (gopkg.in/yaml.v2, YAML 1.1) types them ([`resolve_plain`]), so a file means the same here.

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_saphyr::Spanned;

/// A 1-based line and column in a YAML file; line 0 means "no position" (e.g. unreadable file).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Pos {
    /// 1-based line.
    pub line: u64,
    /// 1-based column.
    pub column: u64,
    /// Byte offset of the node in the text, when known (to recover a plain scalar's spelling).
    byte_offset: Option<u64>,
    /// Byte length of the node in the text, when known.
    byte_len: Option<u64>,
}

impl Pos {
    /// A position with only line and column.
    pub fn new(line: u64, column: u64) -> Pos {
        Pos {
            line,
            column,
            byte_offset: None,
            byte_len: None,
        }
    }

    /// The position of a serde-saphyr location.
    pub fn of(location: serde_saphyr::Location) -> Pos {
        let span = location.span();
        Pos {
            line: location.line(),
            column: location.column(),
            byte_offset: span.byte_offset(),
            byte_len: span.byte_len(),
        }
    }
}

/// One YAML node and where it starts.
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    /// Where the node starts (for a mapping entry's key: the key itself).
    pub pos: Pos,
    /// What it is.
    pub value: Value,
}

/// The shape of a YAML node.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// `~`, `null` or nothing.
    Null,
    /// `true` / `false` (YAML 1.1 spellings such as `yes` included).
    Bool(bool),
    /// An integer (64-bit range either sign).
    Int(i128),
    /// A floating point number.
    Float(f64),
    /// A string scalar.
    Str(String),
    /// A sequence, in order.
    Seq(Vec<Node>),
    /// A mapping, entries in file order.
    Map(Vec<(Node, Node)>),
}

impl Value {
    /// What kind of node this is, for messages ("a mapping", "a string", ...).
    pub fn kind(&self) -> &'static str {
        match self {
            Value::Null => "null",
            Value::Bool(_) => "a boolean",
            Value::Int(_) => "an integer",
            Value::Float(_) => "a number",
            Value::Str(_) => "a string",
            Value::Seq(_) => "a list",
            Value::Map(_) => "a mapping",
        }
    }
}

impl Node {
    /// The scalar's text as written: strings as parsed, other plain scalars (`200`, `yes`,
    /// `0x10`) in their source spelling when `source` is the text they were parsed from, as Go's
    /// yaml.v2 does for a string field. `None` for null, lists and mappings.
    pub fn scalar_text(&self, source: &str) -> Option<String> {
        match &self.value {
            Value::Str(text) => Some(text.clone()),
            Value::Bool(_) | Value::Int(_) | Value::Float(_) => {
                Some(self.raw(source).unwrap_or_else(|| self.canonical()))
            }
            Value::Null | Value::Seq(_) | Value::Map(_) => None,
        }
    }

    /// The source slice of a plain scalar, if the span is available and looks right.
    fn raw(&self, source: &str) -> Option<String> {
        let start = usize::try_from(self.pos.byte_offset?).ok()?;
        let len = usize::try_from(self.pos.byte_len?).ok()?;
        let text = source.get(start..start.checked_add(len)?)?.trim();
        let plain = !text.is_empty()
            && !text.starts_with(['"', '\'', '!', '&', '*', '|', '>'])
            && !text.contains(['\n', '#'])
            && !tagged(&source[..start]);
        plain.then(|| text.to_owned())
    }

    /// A canonical spelling of a non-string scalar.
    fn canonical(&self) -> String {
        match &self.value {
            Value::Bool(b) => b.to_string(),
            Value::Int(i) => i.to_string(),
            Value::Float(f) => f.to_string(),
            Value::Str(s) => s.clone(),
            Value::Null | Value::Seq(_) | Value::Map(_) => String::new(),
        }
    }
}

/// Whether the scalar after `before` carries a tag (`!!str 010`), perhaps beside an anchor:
/// its span starts after them.
fn tagged(before: &str) -> bool {
    let tokens = before
        .split(|c: char| c.is_whitespace() || matches!(c, '[' | '{' | ','))
        .filter(|token| !token.is_empty());
    for token in tokens.rev() {
        if token.starts_with('!') {
            return true;
        }
        if !token.starts_with('&') {
            return false;
        }
    }
    false
}

/// Parses one YAML document into a [`Node`] tree. An empty document is a `Null` node at line 1.
pub fn parse(text: &str) -> Result<Node, serde_saphyr::Error> {
    if text.trim().is_empty() {
        return Ok(Node {
            pos: Pos::new(1, 1),
            value: Value::Null,
        });
    }
    let mut root = serde_saphyr::from_str::<Node>(text)?;
    if root.pos.line == 0 {
        root.pos = Pos::new(1, 1);
    }
    retype_plain_scalars(&mut root, text);
    Ok(root)
}

/// Gives every plain scalar of the tree the type yaml.v2 gives its spelling (`y`, `on` are
/// booleans, `010` is 8, `1_000` is 1000); quoted, tagged and block scalars keep theirs.
fn retype_plain_scalars(node: &mut Node, source: &str) {
    match &mut node.value {
        Value::Seq(items) => {
            for item in items {
                retype_plain_scalars(item, source);
            }
        }
        Value::Map(entries) => {
            for (key, value) in entries {
                retype_plain_scalars(key, source);
                retype_plain_scalars(value, source);
            }
        }
        _ => {
            let Some(raw) = node.raw(source) else {
                return;
            };
            // A string whose span does not spell it (never seen) is left as parsed.
            if matches!(&node.value, Value::Str(text) if *text != raw) {
                return;
            }
            node.value = resolve_plain(&raw);
        }
    }
}

/// The value gopkg.in/yaml.v2 (v2.4.0, `resolve.go`) gives an untagged plain scalar: its
/// YAML 1.1 booleans and nulls, Go's base-prefixed integers (`0x`, `0o`, `0b`, a leading `0`
/// for octal) with `_` ignored, floats of its float pattern, and strings for everything else
/// (timestamps included: they reach the config as their spelling).
pub fn resolve_plain(text: &str) -> Value {
    const TRUE: &[&str] = &[
        "y", "Y", "yes", "Yes", "YES", "true", "True", "TRUE", "on", "On", "ON",
    ];
    const FALSE: &[&str] = &[
        "n", "N", "no", "No", "NO", "false", "False", "FALSE", "off", "Off", "OFF",
    ];
    const NULL: &[&str] = &["", "~", "null", "Null", "NULL"];
    if TRUE.contains(&text) {
        return Value::Bool(true);
    }
    if FALSE.contains(&text) {
        return Value::Bool(false);
    }
    if NULL.contains(&text) {
        return Value::Null;
    }
    match text {
        ".nan" | ".NaN" | ".NAN" => return Value::Float(f64::NAN),
        ".inf" | ".Inf" | ".INF" | "+.inf" | "+.Inf" | "+.INF" => {
            return Value::Float(f64::INFINITY);
        }
        "-.inf" | "-.Inf" | "-.INF" => return Value::Float(f64::NEG_INFINITY),
        _ => {}
    }
    match text.as_bytes()[0] {
        // Not in the table above: maybe a plain float.
        b'.' => text
            .parse::<f64>()
            .map_or_else(|_| Value::Str(text.to_owned()), Value::Float),
        b'0'..=b'9' | b'+' | b'-' => {
            let plain = text.replace('_', "");
            if let Some(int) = go_parse_int(&plain) {
                return Value::Int(int);
            }
            if is_yaml_float(&plain)
                && let Ok(float) = plain.parse::<f64>()
            {
                return Value::Float(float);
            }
            Value::Str(text.to_owned())
        }
        _ => Value::Str(text.to_owned()),
    }
}

/// Go's `strconv.ParseInt(text, 0, 64)`, falling back to `ParseUint(text, 0, 64)` as yaml.v2
/// does: an optional sign (`+` only for the signed range), then `0x`, `0o`, `0b` or a leading
/// `0` (octal), then at least one digit of that base.
fn go_parse_int(text: &str) -> Option<i128> {
    let (negative, signed, rest) = match text.as_bytes().first()? {
        b'-' => (true, true, &text[1..]),
        b'+' => (false, true, &text[1..]),
        _ => (false, false, text),
    };
    let lower = rest.to_ascii_lowercase();
    let (radix, digits) = if let Some(digits) = lower.strip_prefix("0x") {
        (16, digits)
    } else if let Some(digits) = lower.strip_prefix("0o") {
        (8, digits)
    } else if let Some(digits) = lower.strip_prefix("0b") {
        (2, digits)
    } else if lower.len() > 1
        && let Some(digits) = lower.strip_prefix('0')
    {
        (8, digits)
    } else {
        (10, lower.as_str())
    };
    // from_str_radix would take a second sign.
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
        return None;
    }
    let magnitude = u128::from_str_radix(digits, radix).ok()?;
    let value = if negative {
        -i128::try_from(magnitude).ok()?
    } else {
        i128::try_from(magnitude).ok()?
    };
    let fits_i64 = i64::try_from(value).is_ok();
    let fits_u64 = !signed && u64::try_from(value).is_ok();
    (fits_i64 || fits_u64).then_some(value)
}

/// yaml.v2's float pattern: `^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$`.
fn is_yaml_float(text: &str) -> bool {
    let digits = |s: &str| s.len() - s.trim_start_matches(|c: char| c.is_ascii_digit()).len();
    let mut rest = text.strip_prefix(['-', '+']).unwrap_or(text);
    if let Some(fraction) = rest.strip_prefix('.') {
        let n = digits(fraction);
        if n == 0 {
            return false;
        }
        rest = &fraction[n..];
    } else {
        let n = digits(rest);
        if n == 0 {
            return false;
        }
        rest = &rest[n..];
        if let Some(fraction) = rest.strip_prefix('.') {
            rest = &fraction[digits(fraction)..];
        }
    }
    if let Some(exponent) = rest.strip_prefix(['e', 'E']) {
        let exponent = exponent.strip_prefix(['-', '+']).unwrap_or(exponent);
        let n = digits(exponent);
        return n > 0 && n == exponent.len();
    }
    rest.is_empty()
}

/// Go's `fmt.Sprintf("%v", x)` of a scalar yaml.v2 decoded: how envoyproxy/ratelimit names a
/// non-string key of a mapping nested in `metadata:` (`0x10` becomes "16", `~` "<nil>").
pub fn go_format(value: &Value) -> Option<String> {
    Some(match value {
        Value::Null => "<nil>".to_owned(),
        Value::Bool(b) => b.to_string(),
        Value::Int(i) => i.to_string(),
        Value::Float(f) => go_format_float(*f),
        Value::Str(s) => s.clone(),
        Value::Seq(_) | Value::Map(_) => return None,
    })
}

/// Go's `%v` of a float64, `strconv.FormatFloat(f, 'g', -1, 64)`: the shortest digits, with
/// an exponent of at least two digits when it is below -4 or 6 and above (`1e+06`).
fn go_format_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".to_owned();
    }
    if f.is_infinite() {
        return if f > 0.0 { "+Inf" } else { "-Inf" }.to_owned();
    }
    // `{:e}` is the shortest round-trip digits as `d.ddde<exp>`.
    let scientific = format!("{f:e}");
    let Some((mantissa, exponent)) = scientific.split_once('e') else {
        return f.to_string();
    };
    let exponent: i32 = exponent.parse().unwrap_or(0);
    if f == 0.0 || (-4..6).contains(&exponent) {
        return f.to_string();
    }
    let sign = if exponent < 0 { '-' } else { '+' };
    format!("{mantissa}e{sign}{:02}", exponent.unsigned_abs())
}

/// A serde-saphyr error as the position it reports and its message without the location suffix.
pub fn describe_error(err: &serde_saphyr::Error) -> (Pos, String) {
    let pos = err
        .location()
        .filter(|location| location.line() > 0)
        .map_or(Pos::new(1, 1), Pos::of);
    let message = err.render_with_options(serde_saphyr::render_options! {
        snippets: serde_saphyr::SnippetMode::Off,
        formatter: &serde_saphyr::UserMessageFormatter,
    });
    let suffix = format!(" at line {}, column {}", pos.line, pos.column);
    let message = message
        .strip_suffix(suffix.as_str())
        .unwrap_or(&message)
        .trim()
        .to_owned();
    (pos, message)
}

impl<'de> Deserialize<'de> for Node {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Node, D::Error> {
        let spanned = Spanned::<Value>::deserialize(deserializer)?;
        Ok(Node {
            pos: Pos::of(spanned.referenced),
            value: spanned.value,
        })
    }
}

impl<'de> Deserialize<'de> for Value {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(ValueVisitor)
    }
}

/// Accepts any YAML node.
struct ValueVisitor;

impl<'de> Visitor<'de> for ValueVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any YAML value")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        Value::deserialize(deserializer)
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Int(i128::from(v)))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Int(i128::from(v)))
    }

    fn visit_i128<E: de::Error>(self, v: i128) -> Result<Value, E> {
        Ok(Value::Int(v))
    }

    fn visit_u128<E: de::Error>(self, v: u128) -> Result<Value, E> {
        // Beyond i128 only matters for messages, which show the spelling anyway.
        Ok(Value::Int(i128::try_from(v).unwrap_or(i128::MAX)))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        Ok(Value::Float(v))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        Ok(Value::Str(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Value, E> {
        Ok(Value::Str(v))
    }

    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Value, E> {
        Ok(Value::Str(String::from_utf8_lossy(v).into_owned()))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element::<Node>()? {
            items.push(item);
        }
        Ok(Value::Seq(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut entries = Vec::new();
        while let Some(key) = map.next_key::<Node>()? {
            let value = map.next_value::<Node>()?;
            entries.push((key, value));
        }
        Ok(Value::Map(entries))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(node: &Node) -> &[(Node, Node)] {
        match &node.value {
            Value::Map(entries) => entries,
            other => panic!("not a map: {other:?}"),
        }
    }

    #[test]
    fn keys_values_and_items_have_positions() {
        let text = "domain: x\ndescriptors:\n  - key: a\n    value: 200\n  - key: b\n";
        let root = parse(text).unwrap();
        assert_eq!((root.pos.line, root.pos.column), (1, 1));
        let top = map(&root);
        assert_eq!(top[0].0.value, Value::Str("domain".into()));
        assert_eq!((top[0].0.pos.line, top[0].0.pos.column), (1, 1));
        assert_eq!((top[0].1.pos.line, top[0].1.pos.column), (1, 9));
        assert_eq!((top[1].0.pos.line, top[1].0.pos.column), (2, 1));
        let Value::Seq(items) = &top[1].1.value else {
            panic!("not a seq")
        };
        assert_eq!((items[0].pos.line, items[0].pos.column), (3, 5));
        assert_eq!((items[1].pos.line, items[1].pos.column), (5, 5));
        let first = map(&items[0]);
        assert_eq!((first[1].0.pos.line, first[1].0.pos.column), (4, 5));
        assert_eq!(first[1].1.value, Value::Int(200));
        assert_eq!((first[1].1.pos.line, first[1].1.pos.column), (4, 12));
        assert_eq!(first[1].1.scalar_text(text).as_deref(), Some("200"));
    }

    #[test]
    fn scalars_keep_their_spelling() {
        let text = "a: yes\nb: 0x10\nc: 1.50\nd: \"q\"\ne: ~\nf:\ng: -3\n";
        let root = parse(text).unwrap();
        let top = map(&root);
        let texts: Vec<_> = top.iter().map(|(_, v)| v.scalar_text(text)).collect();
        assert_eq!(
            texts,
            [
                Some("yes".to_owned()),
                Some("0x10".to_owned()),
                Some("1.50".to_owned()),
                Some("q".to_owned()),
                None,
                None,
                Some("-3".to_owned()),
            ]
        );
        assert_eq!(top[0].1.value, Value::Bool(true));
        assert_eq!(top[1].1.value, Value::Int(16));
        assert_eq!(top[6].1.value, Value::Int(-3));
    }

    #[test]
    fn flow_style_and_empty_documents() {
        let text = "a: {b: [1, 2], c: x}\n";
        let root = parse(text).unwrap();
        let top = map(&root);
        let inner = map(&top[0].1);
        assert_eq!((inner[1].0.pos.line, inner[1].0.pos.column), (1, 16));
        assert_eq!(parse("").unwrap().value, Value::Null);
        assert_eq!(parse("# only a comment\n").unwrap().value, Value::Null);
    }

    #[test]
    fn syntax_errors_have_a_location() {
        let err = parse("a: [1, 2\nb: c\n").unwrap_err();
        let (pos, message) = describe_error(&err);
        assert_eq!((pos.line, pos.column), (2, 2));
        assert!(!message.contains("line 2"), "{message}");
        let err = parse("a: b\na: c\n").unwrap_err();
        let (pos, message) = describe_error(&err);
        assert_eq!(pos.line, 2);
        assert!(message.contains("duplicate mapping key"), "{message}");
    }

    #[test]
    fn plain_scalars_are_typed_as_yaml_v2_types_them() {
        use Value::{Bool, Float, Int, Null, Str};
        let s = |text: &str| Str(text.to_owned());
        for (text, expected) in [
            ("y", Bool(true)),
            ("Yes", Bool(true)),
            ("ON", Bool(true)),
            ("True", Bool(true)),
            ("n", Bool(false)),
            ("NO", Bool(false)),
            ("Off", Bool(false)),
            ("FALSE", Bool(false)),
            // Only the three spellings of each word, as in yaml.v2's table.
            ("tRUE", s("tRUE")),
            ("oN", s("oN")),
            ("~", Null),
            ("NULL", Null),
            ("nULL", s("nULL")),
            ("010", Int(8)),
            ("0o17", Int(15)),
            ("0x1F", Int(31)),
            ("-0b11", Int(-3)),
            ("+12", Int(12)),
            ("1_000", Int(1000)),
            ("1__0", Int(10)),
            ("9223372036854775808", Int(9_223_372_036_854_775_808)),
            ("18446744073709551616", Float(18_446_744_073_709_551_616.0)),
            ("-9223372036854775809", Float(-9_223_372_036_854_775_809.0)),
            ("08", Float(8.0)),
            ("1e3", Float(1000.0)),
            (".5", Float(0.5)),
            ("1.", Float(1.0)),
            ("-.inf", Float(f64::NEG_INFINITY)),
            ("0x", s("0x")),
            ("1e", s("1e")),
            ("+", s("+")),
            ("2001-12-14", s("2001-12-14")),
            ("1:30", s("1:30")),
            ("abc", s("abc")),
        ] {
            assert_eq!(resolve_plain(text), expected, "{text}");
        }
        assert!(matches!(resolve_plain(".NaN"), Float(f) if f.is_nan()));
    }

    #[test]
    fn nested_metadata_keys_are_spelled_as_gos_percent_v() {
        // What envoyproxy/ratelimit f2fb157 answered for these keys of a mapping in metadata.
        for (text, expected) in [
            ("1e6", "1e+06"),
            ("0.00001", "1e-05"),
            ("123456.5", "123456.5"),
            ("1.5", "1.5"),
            (".5", "0.5"),
            ("08", "8"),
            ("-0b11", "-3"),
            ("0o17", "15"),
            ("9223372036854775808", "9223372036854775808"),
            ("Off", "false"),
            ("TRUE", "true"),
            ("~", "<nil>"),
            ("2001-12-14", "2001-12-14"),
        ] {
            assert_eq!(
                go_format(&resolve_plain(text)).as_deref(),
                Some(expected),
                "{text}"
            );
        }
    }

    #[test]
    fn only_plain_scalars_are_retyped() {
        let text = "a: y\nb: 'y'\nc: !!str 010\nd: 010\ne: \"on\"\ny: on\nz: [!!str y, &a n]\n";
        let root = parse(text).unwrap();
        let top = map(&root);
        let values: Vec<&Value> = top[..6].iter().map(|(_, v)| &v.value).collect();
        assert_eq!(
            values,
            [
                &Value::Bool(true),
                &Value::Str("y".into()),
                &Value::Str("010".into()),
                &Value::Int(8),
                &Value::Str("on".into()),
                &Value::Bool(true),
            ]
        );
        let Value::Seq(items) = &top[6].1.value else {
            panic!("not a seq")
        };
        assert_eq!(items[0].value, Value::Str("y".into()));
        assert_eq!(items[1].value, Value::Bool(false));
        // Keys too, and their spelling stays recoverable.
        assert_eq!(top[5].0.value, Value::Bool(true));
        assert_eq!(top[5].0.scalar_text(text).as_deref(), Some("y"));
    }
}
