//! Layers only point down: no module of `src/` imports from a module that
//! imports it back, directly or through others.
//!
//! The test reads every module file of the library, resolves each path it
//! names (`use crate::...`, `use super::...`, `use child::...`, and the same
//! paths written inline, e.g. `crate::backend::cpu::check_rows(..)`) to the
//! module that defines the item, following `pub use` re-exports, and looks
//! for cycles in the resulting module graph. A parent that only declares a
//! child (`mod x;`) does not depend on it; `#[cfg(test)]` modules are not
//! part of the layering.
//!
//! Cycles that still exist are listed in [`KNOWN_CYCLES`]: a new cycle, or a
//! listed one that grew, fails the test, and so does a listed one that is gone
//! (remove it from the list), so the list can only shrink.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Module cycles of today's tree, each as the sorted set of its modules:
/// none. A cycle that appears fails the test.
const KNOWN_CYCLES: &[&[&str]] = &[];

/// One module file.
struct Module {
    /// Code with comments, strings and `#[cfg(test)]` modules removed.
    code: String,
    /// Child modules declared in the file.
    children: BTreeSet<String>,
}

fn module_path(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).expect("under src");
    let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    let last = parts.pop().expect("a file name");
    let stem = last.trim_end_matches(".rs").to_string();
    if stem != "mod" && stem != "lib" {
        parts.push(stem);
    }
    std::iter::once("crate".to_string()).chain(parts).collect::<Vec<_>>().join("::")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("readable src dir") {
        let p = e.expect("dir entry").path();
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n != "bin") {
                rust_files(&p, out);
            }
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Removes comments, string and char literals (keeping the code's shape).
fn strip(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                let mut depth = 0;
                while i < b.len() {
                    if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                        depth += 1;
                        i += 2;
                    } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                        depth -= 1;
                        i += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        i += 1;
                    }
                }
            }
            b'r' if matches!(b.get(i + 1), Some(b'"') | Some(b'#')) && (i == 0 || !is_ident(b[i - 1])) => {
                let mut j = i + 1;
                let mut hashes = 0;
                while b.get(j) == Some(&b'#') {
                    hashes += 1;
                    j += 1;
                }
                if b.get(j) != Some(&b'"') {
                    out.push('r');
                    i += 1;
                    continue;
                }
                j += 1;
                let close: Vec<u8> = std::iter::once(b'"').chain(std::iter::repeat(b'#').take(hashes)).collect();
                while j < b.len() && !b[j..].starts_with(&close) {
                    j += 1;
                }
                i = j + close.len();
                out.push_str("\"\"");
            }
            b'"' => {
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
                out.push_str("\"\"");
            }
            b'\'' if b.get(i + 2) == Some(&b'\'') || (b.get(i + 1) == Some(&b'\\')) => {
                // A char literal ('a', '\n', '\''); lifetimes have no closing quote.
                let mut j = i + 1;
                if b[j] == b'\\' {
                    j += 2;
                }
                while j < b.len() && b[j] != b'\'' {
                    j += 1;
                }
                i = j + 1;
                out.push_str("' '");
            }
            c => {
                out.push(c as char);
                i += 1;
            }
        }
    }
    out
}

fn is_ident(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// Drops every `#[cfg(test)]` item that is a module (`mod x { ... }`).
fn drop_test_modules(code: &str) -> String {
    let mut out = code.to_string();
    while let Some(at) = out.find("#[cfg(test)]") {
        let rest = &out[at..];
        let Some(brace) = rest.find('{') else { break };
        let head = &rest[..brace];
        if !head.contains("mod ") || head.contains(';') {
            // `#[cfg(test)]` on something else: keep it, look further.
            out.replace_range(at..at + "#[cfg(test)]".len(), "");
            continue;
        }
        let mut depth = 0;
        let mut end = at + brace;
        for (k, ch) in out[at + brace..].char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = at + brace + k + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        out.replace_range(at..end, "");
    }
    out
}

/// The `use` statements of `code` (the text between `use` and `;`), with
/// whether each is a re-export (`pub use` / `pub(crate) use`).
fn use_statements(code: &str) -> Vec<(bool, String)> {
    let b = code.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(k) = code[i..].find("use ") {
        let at = i + k;
        i = at + 4;
        if at > 0 && is_ident(b[at - 1]) {
            continue;
        }
        let before = code[..at].trim_end();
        let public = before.ends_with("pub") || before.ends_with(')') && before.contains("pub(");
        let line_start = code[..at].rfind(['\n', ';', '{', '}']).map_or(0, |p| p + 1);
        let lead = code[line_start..at].trim();
        if !(lead.is_empty() || lead.starts_with("pub") || lead.starts_with("#[")) {
            continue;
        }
        let Some(end) = code[at..].find(';') else { break };
        out.push((public, code[at + 4..at + end].split_whitespace().collect::<Vec<_>>().join("")));
        i = at + end;
    }
    out
}

/// Expands a use tree (`a::{b, c::d as e, f::*}`) into `(path, exported name)`.
fn expand(tree: &str) -> Vec<(Vec<String>, String)> {
    fn go(prefix: &[String], t: &str, out: &mut Vec<(Vec<String>, String)>) {
        let t = t.trim_matches(|c| c == ',');
        if t.is_empty() {
            return;
        }
        if let Some(open) = t.find('{') {
            let head: Vec<String> =
                t[..open].trim_end_matches("::").split("::").filter(|s| !s.is_empty()).map(String::from).collect();
            let inner = &t[open + 1..t.rfind('}').expect("balanced use tree")];
            let p: Vec<String> = prefix.iter().cloned().chain(head).collect();
            let mut depth = 0;
            let mut start = 0;
            for (k, c) in inner.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        go(&p, &inner[start..k], out);
                        start = k + 1;
                    }
                    _ => {}
                }
            }
            go(&p, &inner[start..], out);
            return;
        }
        let (path, alias) = match t.split_once("as") {
            Some((p, a)) if t.contains("as") && !a.contains("::") && p.ends_with(|c: char| is_ident(c as u8)) => {
                (p, Some(a.to_string()))
            }
            _ => (t, None),
        };
        let segs: Vec<String> = prefix.iter().cloned().chain(path.split("::").map(String::from)).collect();
        let name = alias.unwrap_or_else(|| segs.last().cloned().unwrap_or_default());
        out.push((segs, name));
    }
    let mut out = Vec::new();
    go(&[], tree, &mut out);
    out
}

struct Graph {
    modules: BTreeMap<String, Module>,
    /// `(module, name)` -> the path it re-exports.
    reexports: BTreeMap<(String, String), Vec<String>>,
    /// Modules with a glob re-export of another (`pub use x::*`).
    globs: BTreeMap<String, Vec<String>>,
    /// `#[macro_export]` macros by name -> defining module.
    macros: BTreeMap<String, String>,
}

impl Graph {
    fn load() -> Graph {
        Graph::load_crate("src")
    }

    /// The modules of the crate whose source root is `dir` (from the repository root).
    fn load_crate(dir: &str) -> Graph {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
        let mut files = Vec::new();
        rust_files(&src, &mut files);
        let mut modules = BTreeMap::new();
        let mut macros = BTreeMap::new();
        for f in &files {
            let text = std::fs::read_to_string(f).expect("readable source");
            let code = drop_test_modules(&strip(&text));
            let path = module_path(&src, f);
            let mut children = BTreeSet::new();
            for line in code.lines() {
                let l = line.trim();
                let l = l.strip_prefix("pub ").or_else(|| l.strip_prefix("pub(crate) ")).unwrap_or(l);
                if let Some(name) = l.strip_prefix("mod ").and_then(|r| r.strip_suffix(';')) {
                    children.insert(name.trim().to_string());
                }
            }
            let mut rest = code.as_str();
            while let Some(k) = rest.find("#[macro_export]") {
                rest = &rest[k..];
                if let Some(m) = rest.find("macro_rules!") {
                    let name: String = rest[m + 12..].trim_start().chars().take_while(|c| is_ident(*c as u8)).collect();
                    macros.insert(name, path.clone());
                }
                rest = &rest[1..];
            }
            modules.insert(path, Module { code, children });
        }
        let mut g = Graph { modules, reexports: BTreeMap::new(), globs: BTreeMap::new(), macros };
        let names: Vec<String> = g.modules.keys().cloned().collect();
        for m in names {
            for (public, tree) in use_statements(&g.modules[&m].code) {
                if !public {
                    continue;
                }
                for (segs, name) in expand(&tree) {
                    let abs = g.absolute(&m, &segs);
                    if name == "*" {
                        g.globs.entry(m.clone()).or_default().push(abs[..abs.len() - 1].join("::"));
                    } else if name != "self" {
                        g.reexports.insert((m.clone(), name), abs);
                    }
                }
            }
        }
        g
    }

    /// `segs` (as written in module `m`) as a path from `crate`.
    fn absolute(&self, m: &str, segs: &[String]) -> Vec<String> {
        let mut base: Vec<String> = m.split("::").map(String::from).collect();
        let mut s = segs;
        match s.first().map(String::as_str) {
            Some("crate") => return segs.to_vec(),
            Some("self") => s = &s[1..],
            Some("super") => {
                while s.first().map(String::as_str) == Some("super") {
                    base.pop();
                    s = &s[1..];
                }
            }
            Some(first) if self.modules[m].children.contains(first) => {}
            _ => return Vec::new(), // an external crate or a local item
        }
        base.into_iter().chain(s.iter().cloned()).collect()
    }

    /// The module defining the item at the absolute path `p`.
    fn resolve(&self, p: &[String], depth: usize) -> Option<String> {
        if p.is_empty() || depth > 16 {
            return None;
        }
        if p.len() == 2 && p[0] == "crate" {
            if let Some(m) = self.macros.get(&p[1]) {
                return Some(m.clone());
            }
        }
        // The longest prefix that is a module file.
        let mut k = p.len();
        while k > 0 && !self.modules.contains_key(&p[..k].join("::")) {
            k -= 1;
        }
        if k == 0 {
            return None;
        }
        let m = p[..k].join("::");
        if k == p.len() {
            return Some(m);
        }
        if let Some(target) = self.reexports.get(&(m.clone(), p[k].clone())) {
            let rest: Vec<String> = target.iter().cloned().chain(p[k + 1..].iter().cloned()).collect();
            return self.resolve(&rest, depth + 1).or(Some(m));
        }
        for glob in self.globs.get(&m).into_iter().flatten() {
            let mut q: Vec<String> = glob.split("::").map(String::from).collect();
            q.extend(p[k..].iter().cloned());
            if let Some(r) = self.resolve(&q, depth + 1) {
                if r != *glob || self.defines(glob, &p[k]) {
                    return Some(r);
                }
            }
        }
        Some(m)
    }

    fn defines(&self, m: &str, name: &str) -> bool {
        let code = &self.modules[m].code;
        ["fn", "struct", "enum", "trait", "type", "const", "static", "union"].iter().any(|kw| {
            let pat = format!("{kw} {name}");
            code.match_indices(&pat).any(|(i, _)| {
                let after = code.as_bytes().get(i + pat.len()).copied().unwrap_or(b' ');
                !is_ident(after)
            })
        })
    }

    /// Every `module -> module` dependency, with one example path each.
    fn edges(&self) -> BTreeMap<(String, String), String> {
        let mut edges = BTreeMap::new();
        for (m, module) in &self.modules {
            let mut paths: Vec<Vec<String>> = Vec::new();
            for (_, tree) in use_statements(&module.code) {
                paths.extend(expand(&tree).into_iter().map(|(s, _)| s));
            }
            // Inline paths: `crate::a::b`, `super::x`, `child::x`.
            let b = module.code.as_bytes();
            let mut i = 0;
            while i < b.len() {
                if is_ident(b[i]) && (i == 0 || !is_ident(b[i - 1]) && b[i - 1] != b'$' && b[i - 1] != b':') {
                    let start = i;
                    while i < b.len() && (is_ident(b[i]) || (b[i] == b':' && b.get(i + 1) == Some(&b':'))) {
                        i += if b[i] == b':' { 2 } else { 1 };
                    }
                    let text = &module.code[start..i];
                    let segs: Vec<String> =
                        text.trim_end_matches("::").split("::").map(String::from).collect::<Vec<_>>();
                    let head = segs[0].as_str();
                    if segs.len() > 1 && (head == "crate" || head == "super" || module.children.contains(head)) {
                        paths.push(segs);
                    }
                } else {
                    i += 1;
                }
            }
            for segs in paths {
                let segs: Vec<String> = segs.into_iter().filter(|s| s != "*" && s != "self").collect();
                let abs = self.absolute(m, &segs);
                if let Some(t) = self.resolve(&abs, 0) {
                    if t != *m {
                        edges.entry((m.clone(), t)).or_insert_with(|| abs.join("::"));
                    }
                }
            }
        }
        edges
    }
}

/// Strongly connected components with more than one module (Tarjan).
fn cycles(edges: &BTreeMap<(String, String), String>) -> Vec<BTreeSet<String>> {
    let mut adj: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (a, b) in edges.keys() {
        adj.entry(a).or_default().push(b);
        adj.entry(b).or_default();
    }
    struct St<'a> {
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<BTreeSet<String>>,
    }
    fn visit<'a>(v: &'a str, adj: &BTreeMap<&'a str, Vec<&'a str>>, s: &mut St<'a>) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on.insert(v);
        for &w in &adj[v] {
            if !s.index.contains_key(w) {
                visit(w, adj, s);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(lw);
            } else if s.on.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut comp = BTreeSet::new();
            while let Some(w) = s.stack.pop() {
                s.on.remove(w);
                comp.insert(w.to_string());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                s.out.push(comp);
            }
        }
    }
    let mut s =
        St { index: BTreeMap::new(), low: BTreeMap::new(), stack: Vec::new(), on: BTreeSet::new(), out: vec![] };
    let nodes: Vec<&str> = adj.keys().copied().collect();
    for v in nodes {
        if !s.index.contains_key(v) {
            visit(v, &adj, &mut s);
        }
    }
    s.out
}

fn describe(c: &BTreeSet<String>, edges: &BTreeMap<(String, String), String>) -> String {
    let inner: Vec<String> = edges
        .iter()
        .filter(|((a, b), _)| c.contains(a) && c.contains(b))
        .map(|((a, b), via)| format!("    {a} -> {b} (via {via})"))
        .collect();
    format!("  {:?}\n{}", c, inner.join("\n"))
}

#[test]
fn no_module_imports_a_module_that_imports_it_back() {
    let g = Graph::load();
    let edges = g.edges();
    let found = cycles(&edges);
    let known: Vec<BTreeSet<String>> = KNOWN_CYCLES.iter().map(|c| c.iter().map(|s| s.to_string()).collect()).collect();
    let new: Vec<String> = found.iter().filter(|c| !known.contains(c)).map(|c| describe(c, &edges)).collect();
    let gone: Vec<&BTreeSet<String>> = known.iter().filter(|k| !found.contains(k)).collect();
    assert!(new.is_empty(), "module cycles (each with the imports that close it):\n{}", new.join("\n"));
    assert!(gone.is_empty(), "these listed cycles no longer exist; remove them from KNOWN_CYCLES: {gone:?}");
}

/// Module cycles of the workspace's other crates today, `(source root, the
/// sorted modules of the cycle)`: none. A cycle that appears fails the test,
/// as for [`KNOWN_CYCLES`].
const KNOWN_CRATE_CYCLES: &[(&str, &[&str])] = &[];

/// The same rule in the workspace's other crates: the simulated CANN runtime
/// and the shared-memory transport.
#[test]
fn no_module_cycle_in_cann_sim_or_shm_comm() {
    let mut new = Vec::new();
    let mut found_all = Vec::new();
    for dir in ["cann-sim/src", "shm-comm/src"] {
        let edges = Graph::load_crate(dir).edges();
        let known: Vec<BTreeSet<String>> = KNOWN_CRATE_CYCLES
            .iter()
            .filter(|(d, _)| *d == dir)
            .map(|(_, c)| c.iter().map(|s| s.to_string()).collect())
            .collect();
        for c in cycles(&edges) {
            if !known.contains(&c) {
                new.push(format!("{dir}:\n{}", describe(&c, &edges)));
            }
            found_all.push((dir, c));
        }
    }
    assert!(new.is_empty(), "module cycles (each with the imports that close it):\n{}", new.join("\n"));
    let gone: Vec<_> = KNOWN_CRATE_CYCLES
        .iter()
        .filter(|(d, c)| {
            let c: BTreeSet<String> = c.iter().map(|s| s.to_string()).collect();
            !found_all.iter().any(|(fd, fc)| fd == d && *fc == c)
        })
        .collect();
    assert!(gone.is_empty(), "these listed cycles no longer exist; remove them from KNOWN_CRATE_CYCLES: {gone:?}");
}

/// `module -> module` imports of the Python package `python/ascend_moe`,
/// wherever they are written (a function-level import closes a cycle as
/// much as a top-level one; it only hides it until the call), each with the
/// line that makes it.
fn python_edges() -> BTreeMap<(String, String), String> {
    let pkg = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/ascend_moe");
    let mut modules = BTreeMap::new();
    for e in std::fs::read_dir(&pkg).expect("python/ascend_moe") {
        let p = e.expect("dir entry").path();
        if p.extension().is_some_and(|x| x == "py") {
            let name = p.file_stem().expect("file name").to_string_lossy().into_owned();
            modules.insert(name, std::fs::read_to_string(&p).expect("readable module"));
        }
    }
    let mut edges = BTreeMap::new();
    for (m, text) in &modules {
        // Triple-quoted strings (docstrings) and comments hold prose, not imports.
        let mut code = String::new();
        for (k, part) in text.split("\"\"\"").enumerate() {
            if k % 2 == 0 {
                code.push_str(part);
            }
        }
        let lines: Vec<String> = code.lines().map(|l| l.split('#').next().unwrap_or("").trim().to_string()).collect();
        let mut i = 0;
        while i < lines.len() {
            let mut stmt = lines[i].clone();
            while stmt.contains('(') && !stmt.contains(')') && i + 1 < lines.len() {
                i += 1;
                stmt.push(' ');
                stmt.push_str(&lines[i]);
            }
            i += 1;
            let mut targets = Vec::new();
            if let Some(rest) = stmt.strip_prefix("from ") {
                let Some((from, names)) = rest.split_once(" import ") else { continue };
                let from = from.trim();
                let sub = from.strip_prefix("ascend_moe").or_else(|| from.strip_prefix('.').map(|_| from));
                let Some(sub) = sub else { continue };
                let sub = sub.trim_start_matches('.');
                if sub.is_empty() {
                    // `from . import a, b`: each name that is a module, else the package.
                    for n in names.trim_matches(|c| c == '(' || c == ')').split(',') {
                        let n = n.split(" as ").next().unwrap_or("").trim();
                        targets.push(if modules.contains_key(n) { n.to_string() } else { "__init__".to_string() });
                    }
                } else {
                    targets.push(sub.split('.').next().unwrap_or(sub).to_string());
                }
            } else if let Some(rest) = stmt.strip_prefix("import ") {
                for n in rest.split(',') {
                    let n = n.split(" as ").next().unwrap_or("").trim();
                    if n == "ascend_moe" {
                        targets.push("__init__".to_string());
                    } else if let Some(sub) = n.strip_prefix("ascend_moe.") {
                        targets.push(sub.split('.').next().unwrap_or(sub).to_string());
                    }
                }
            }
            for t in targets {
                if t != *m && modules.contains_key(&t) {
                    edges.entry((m.clone(), t)).or_insert_with(|| stmt.clone());
                }
            }
        }
    }
    edges
}

/// The Python package's modules import one way too (the package's
/// `__init__` imports the modules; none imports the package back).
#[test]
fn no_module_cycle_in_the_python_package() {
    let edges = python_edges();
    let has = |a: &str, b: &str| edges.contains_key(&(a.to_string(), b.to_string()));
    // The scanner sees relative, parenthesised and function-level imports.
    assert!(has("__init__", "_errors") && has("__init__", "_torch_ops") && has("comm", "shapes"), "{edges:#?}");
    assert!(has("_torch_ops", "forward"), "a function-level import is an edge: {edges:#?}");
    let found: Vec<String> = cycles(&edges).iter().map(|c| describe(c, &edges)).collect();
    assert!(found.is_empty(), "module cycles in python/ascend_moe:\n{}", found.join("\n"));
    // The generated enums and the exceptions are the package's leaves.
    for leaf in ["_enums", "_errors"] {
        let up: Vec<_> = edges.keys().filter(|(a, b)| a == leaf && b != "_errors").collect();
        assert!(up.is_empty(), "{leaf} imports {up:?}");
    }
}

/// The analysis itself: it sees the kinds of imports the crate uses.
#[test]
fn the_import_scanner_resolves_re_exports_super_and_inline_paths() {
    let g = Graph::load();
    let edges = g.edges();
    let has = |a: &str, b: &str| edges.contains_key(&(a.to_string(), b.to_string()));
    // `use crate::{DType, ...}` through lib.rs's `pub use types::{DType, Element}`
    // and types' `pub use dtype::DType`.
    assert!(has("crate::error", "crate::types::dtype"), "{edges:#?}");
    // A `pub use` of a child is the parent depending on the child.
    assert!(has("crate::backend::cpu", "crate::backend::cpu::comm"));
    // `super::` paths.
    assert!(has("crate::testing::layer::run", "crate::testing::layer::case"));
    assert!(!has("crate::types", "crate::error"), "types is a leaf");
    let in_types = |m: &str| m == "crate::types" || m.starts_with("crate::types::");
    let out: Vec<_> = edges.keys().filter(|(a, b)| in_types(a) && !in_types(b)).collect();
    assert!(out.is_empty(), "types imports nothing of the crate outside itself: {out:?}");
    // A two-module cycle is reported.
    let mut e = BTreeMap::new();
    e.insert(("a".to_string(), "b".to_string()), String::new());
    e.insert(("b".to_string(), "a".to_string()), String::new());
    e.insert(("b".to_string(), "c".to_string()), String::new());
    assert_eq!(cycles(&e), vec![BTreeSet::from(["a".to_string(), "b".to_string()])]);
}

/// The C ABI's shared types (status, enums, descriptors, handles and the
/// stream accessor) are its leaf: every other `capi` module may use them,
/// and they use no `capi` module back.
#[test]
fn capi_types_imports_no_other_capi_module() {
    let g = Graph::load();
    let edges = g.edges();
    let up: Vec<&(String, String)> =
        edges.keys().filter(|(a, b)| a == "crate::capi::types" && b.starts_with("crate::capi")).collect();
    assert!(up.is_empty(), "crate::capi::types imports {up:?}");
    for m in ["crate::capi::comm", "crate::capi::ffi", "crate::capi::live", "crate::capi::finalize"] {
        assert!(edges.contains_key(&(m.to_string(), "crate::capi::types".to_string())), "{m} does not use capi::types");
    }
}
