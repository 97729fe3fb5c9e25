//! The descriptor tree walk of envoyproxy/ratelimit: exact, then wildcards, then default.

use crate::config::{Level, Node};

/// The node a request descriptor lands on, if its **last** entry matched at its own depth.
///
/// At each level an exact `key`+`value` wins, then wildcard values in config order, then the
/// bare `key`. More entries than the tree is deep means no node.
pub fn find<'c, K, V>(root: &'c Level, entries: &[(K, V)]) -> Option<&'c Node>
where
    K: AsRef<str>,
    V: AsRef<str>,
{
    let mut level = root;
    let (last, parents) = entries.split_last()?;
    for (key, value) in parents {
        level = &step(level, key.as_ref(), value.as_ref())?.children;
    }
    step(level, last.0.as_ref(), last.1.as_ref())
}

fn step<'c>(level: &'c Level, key: &str, value: &str) -> Option<&'c Node> {
    let nodes = level.keys.get(key)?;
    nodes
        .exact
        .get(value)
        .or_else(|| {
            nodes
                .wildcards
                .iter()
                .find(|(pattern, _)| pattern.matches(value))
                .map(|(_, node)| node)
        })
        .or(nodes.default.as_deref())
}
