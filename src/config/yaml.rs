//! A generic YAML tree where every node (map keys included) carries its line and column.
//!
//! serde-saphyr parses the text; [`Node`]'s own `Deserialize` impl accepts any scalar, sequence
//! or mapping and wraps each in [`serde_saphyr::Spanned`], so the loader can report every problem
//! of a file at the exact key or value it concerns, instead of stopping at the first.

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
            && !text.contains(['\n', '#']);
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
    Ok(root)
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
}
