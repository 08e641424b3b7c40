//! The responses kept for `previous_response_id` and `GET /v1/responses/{id}`: in memory,
//! bounded in entries, bytes and age. The least recently used go first, and any left unused
//! for longer than the age bound.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde_json::Value;

/// A response as it is kept.
#[derive(Debug)]
pub(crate) struct StoredResponse {
    /// The response object, as `GET` answers it.
    pub(crate) response: Value,
    /// The conversation through the response's output, as chat messages: what a request that
    /// continues it starts from. Its `instructions` are not in it; a continuation does not
    /// inherit them.
    pub(crate) conversation: Vec<Value>,
}

impl StoredResponse {
    /// Its size as JSON, near enough to what it holds in memory.
    fn bytes(&self) -> usize {
        let json_len = |value: &Value| value.to_string().len();
        json_len(&self.response) + self.conversation.iter().map(json_len).sum::<usize>()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StoreLimits {
    pub(crate) entries: usize,
    pub(crate) bytes: usize,
    /// How long a response is kept after it was last used.
    pub(crate) max_idle: Duration,
}

pub(crate) struct ResponseStore {
    limits: StoreLimits,
    entries: Mutex<Entries>,
}

#[derive(Default)]
struct Entries {
    by_id: HashMap<String, Entry>,
    /// Ids by last use, least recent first: the order of eviction, and of expiry.
    by_use: BTreeMap<u64, String>,
    uses: u64,
    bytes: usize,
}

struct Entry {
    response: Arc<StoredResponse>,
    bytes: usize,
    /// Its key in `by_use`.
    use_number: u64,
    used_at: Instant,
}

impl ResponseStore {
    pub(crate) fn new(limits: StoreLimits) -> Self {
        ResponseStore {
            limits,
            entries: Mutex::default(),
        }
    }

    /// Keeps `response` under `id`, making room by evicting the least recently used. One too
    /// large for the whole store is not kept.
    pub(crate) fn insert(&self, id: String, response: StoredResponse, now: Instant) {
        let bytes = response.bytes();
        let mut entries = self.lock(now);
        entries.remove(&id);
        if bytes > self.limits.bytes || self.limits.entries == 0 {
            return;
        }
        let entry = Entry {
            response: Arc::new(response),
            bytes,
            use_number: entries.next_use(&id),
            used_at: now,
        };
        entries.bytes += bytes;
        entries.by_id.insert(id, entry);
        while entries.by_id.len() > self.limits.entries || entries.bytes > self.limits.bytes {
            entries.evict_least_recent();
        }
    }

    /// The response kept under `id`, now used again.
    pub(crate) fn get(&self, id: &str, now: Instant) -> Option<Arc<StoredResponse>> {
        let mut entries = self.lock(now);
        let old_use = entries.by_id.get(id)?.use_number;
        entries.by_use.remove(&old_use);
        let use_number = entries.next_use(id);
        let entry = entries.by_id.get_mut(id)?;
        entry.use_number = use_number;
        entry.used_at = now;
        Some(entry.response.clone())
    }

    /// Forgets the response kept under `id`; whether there was one.
    pub(crate) fn remove(&self, id: &str, now: Instant) -> bool {
        self.lock(now).remove(id)
    }

    /// The entries, rid of those unused for longer than the age bound.
    fn lock(&self, now: Instant) -> std::sync::MutexGuard<'_, Entries> {
        // No change to the entries panics midway, so those of a poisoned lock are whole.
        let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        while entries
            .least_recent_use()
            .is_some_and(|used_at| now.saturating_duration_since(used_at) > self.limits.max_idle)
        {
            entries.evict_least_recent();
        }
        entries
    }
}

impl Entries {
    /// A use number for `id`, later than all before it.
    fn next_use(&mut self, id: &str) -> u64 {
        self.uses += 1;
        self.by_use.insert(self.uses, id.to_owned());
        self.uses
    }

    fn least_recent_use(&self) -> Option<Instant> {
        let (_, id) = self.by_use.first_key_value()?;
        Some(self.by_id[id].used_at)
    }

    fn evict_least_recent(&mut self) {
        if let Some((_, id)) = self.by_use.pop_first() {
            if let Some(entry) = self.by_id.remove(&id) {
                self.bytes -= entry.bytes;
            }
        }
    }

    fn remove(&mut self, id: &str) -> bool {
        let Some(entry) = self.by_id.remove(id) else {
            return false;
        };
        self.by_use.remove(&entry.use_number);
        self.bytes -= entry.bytes;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn stored(text: &str) -> StoredResponse {
        StoredResponse {
            response: json!({"id": text}),
            conversation: vec![json!({"role": "user", "content": text})],
        }
    }

    fn store(entries: usize, bytes: usize, max_idle: Duration) -> ResponseStore {
        ResponseStore::new(StoreLimits {
            entries,
            bytes,
            max_idle,
        })
    }

    const HOUR: Duration = Duration::from_secs(3600);

    #[test]
    fn the_least_recently_used_go_first() {
        let store = store(2, usize::MAX, HOUR);
        let now = Instant::now();
        store.insert("a".into(), stored("a"), now);
        store.insert("b".into(), stored("b"), now);
        // `a` used again: `b` is now the least recent.
        assert_eq!(store.get("a", now).unwrap().response["id"], "a");
        store.insert("c".into(), stored("c"), now);
        assert!(store.get("b", now).is_none());
        assert!(store.get("a", now).is_some() && store.get("c", now).is_some());
    }

    #[test]
    fn bytes_are_bounded() {
        let size = stored("a").bytes();
        let store = store(10, 2 * size, HOUR);
        let now = Instant::now();
        for id in ["a", "b", "c"] {
            store.insert(id.into(), stored(id), now);
        }
        assert!(store.get("a", now).is_none());
        assert!(store.get("b", now).is_some() && store.get("c", now).is_some());
        // One larger than the whole store is not kept, and evicts nothing.
        store.insert("big".into(), stored(&"x".repeat(2 * size)), now);
        assert!(store.get("big", now).is_none());
        assert!(store.get("b", now).is_some() && store.get("c", now).is_some());
        // Replacing an entry frees the bytes of the old one.
        store.insert("b".into(), stored("b"), now);
        assert_eq!(store.entries.lock().unwrap().bytes, 2 * size);
    }

    #[test]
    fn unused_entries_expire() {
        let store = store(10, usize::MAX, HOUR);
        let start = Instant::now();
        store.insert("a".into(), stored("a"), start);
        store.insert("b".into(), stored("b"), start);
        // A use keeps `b` for another hour.
        assert!(store.get("b", start + HOUR / 2).is_some());
        let later = start + HOUR + Duration::from_secs(1);
        assert!(store.get("a", later).is_none());
        assert!(store.get("b", later).is_some());
        assert_eq!(store.entries.lock().unwrap().by_id.len(), 1);
    }

    #[test]
    fn removed_entries_are_gone() {
        let store = store(10, usize::MAX, HOUR);
        let now = Instant::now();
        store.insert("a".into(), stored("a"), now);
        assert!(store.remove("a", now));
        assert!(!store.remove("a", now));
        assert!(store.get("a", now).is_none());
        let entries = store.entries.lock().unwrap();
        assert!(entries.by_use.is_empty() && entries.bytes == 0);
    }

    #[test]
    fn a_store_of_no_entries_keeps_nothing() {
        let store = store(0, usize::MAX, HOUR);
        let now = Instant::now();
        store.insert("a".into(), stored("a"), now);
        assert!(store.get("a", now).is_none());
    }
}
