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
    walk(root, entries, |_, _| {})
}

/// [`find`], telling `visit` the node each entry matched (by entry index), last one included;
/// when the walk fails part way, the nodes visited so far have been told.
pub fn walk<'c, K, V>(
    root: &'c Level,
    entries: &[(K, V)],
    mut visit: impl FnMut(usize, &'c Node),
) -> Option<&'c Node>
where
    K: AsRef<str>,
    V: AsRef<str>,
{
    let mut level = root;
    let (last, parents) = entries.split_last()?;
    for (index, (key, value)) in parents.iter().enumerate() {
        let node = step(level, key.as_ref(), value.as_ref())?;
        visit(index, node);
        level = &node.children;
    }
    let node = step(level, last.0.as_ref(), last.1.as_ref())?;
    visit(parents.len(), node);
    Some(node)
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
