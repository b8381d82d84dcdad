//! Generated prompts: lower-case English words from a fixed list, about
//! one token each in GPT-2-style BPE vocabularies, with a full stop every
//! 8 to 15 words.
//!
//! Prompts must be unique from their first token, or a server that caches
//! prompt prefixes (llama-server reuses a slot's longest common prefix)
//! skips most of the prefill and the benchmark measures the cache. So the
//! first words of prompt `i` spell `i` in base [`WORDS`]`.len()`; the rest is
//! drawn from the seed's stream for `i`.

use crate::arrival::Rng;

/// 256 common words; `tests::words_are_distinct` keeps them so.
#[rustfmt::skip] // one word per line otherwise
pub const WORDS: [&str; 256] = [
    "time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child", "world", "school", "state",
    "family", "student", "group", "country", "problem", "hand", "part", "place", "case", "week", "company", "system",
    "program", "question", "work", "government", "number", "night", "point", "home", "water", "room", "mother",
    "area", "money", "story", "fact", "month", "lot", "right", "study", "book", "eye", "job", "word", "business",
    "issue", "side", "kind", "head", "house", "service", "friend", "father", "power", "hour", "game", "line", "end",
    "member", "law", "car", "city", "community", "name", "president", "team", "minute", "idea", "kid", "body",
    "information", "back", "parent", "face", "others", "level", "office", "door", "health", "person", "art", "war",
    "history", "party", "result", "change", "morning", "reason", "research", "girl", "guy", "moment", "air",
    "teacher", "force", "education", "food", "music", "river", "garden", "market", "window", "table", "paper",
    "light", "field", "road", "stone", "tree", "bird", "horse", "ship", "train", "bridge", "summer", "winter",
    "spring", "island", "mountain", "forest", "village", "letter", "picture", "song", "dream", "voice", "color",
    "fire", "earth", "sea", "sun", "moon", "star", "rain", "snow", "wind", "cloud", "animal", "plant", "farm",
    "church", "street", "king", "queen", "army", "doctor", "lawyer", "artist", "writer", "player", "leader",
    "police", "court", "bank", "price", "cost", "plan", "rule", "test", "class", "course", "film", "movie", "video",
    "phone", "computer", "machine", "energy", "oil", "gold", "iron", "glass", "wood", "salt", "bread", "milk",
    "coffee", "tea", "wine", "fish", "meat", "apple", "egg", "cake", "dinner", "lunch", "breakfast", "kitchen",
    "bed", "chair", "box", "bag", "key", "card", "gift", "ball", "toy", "clock", "map", "flag", "page", "radio",
    "boat", "plane", "truck", "station", "hotel", "hospital", "museum", "library", "park", "beach", "lake", "hill",
    "valley", "desert", "ocean", "coast", "north", "south", "east", "west", "center", "corner", "edge", "surface",
    "shape", "size", "weight", "speed", "distance", "season", "age", "birth", "death", "peace", "love", "fear",
    "hope", "truth", "science", "nature", "culture", "language", "network", "signal", "engine", "wheel", "tool",
    "metal", "cotton", "silver",
];

/// `n` prompts of about `tokens` tokens each, unique, the same for the same seed.
pub fn generate(n: usize, tokens: usize, seed: u64) -> Vec<String> {
    let w = WORDS.len();
    // Enough leading "digits" to spell every index.
    let mut digits = 1;
    let mut span = w;
    while span < n {
        digits += 1;
        span = span.saturating_mul(w);
    }
    // Rotating the digits by the seed keeps them distinct and makes the
    // first word depend on the seed too.
    let rot = (seed % w as u64) as usize;
    (0..n)
        .map(|i| {
            let mut rng = Rng::stream(seed, i as u64);
            let mut out = String::with_capacity(tokens * 8);
            let mut used = 0;
            let mut rest = i;
            for _ in 0..digits {
                push_word(&mut out, WORDS[(rest % w + rot) % w]);
                rest /= w;
                used += 1;
            }
            let mut sentence = digits;
            let mut sentence_len = 8 + rng.below(8);
            // One token is kept for the closing full stop.
            while used + 1 < tokens {
                if sentence >= sentence_len && used + 2 < tokens {
                    out.push('.');
                    used += 1;
                    sentence = 0;
                    sentence_len = 8 + rng.below(8);
                }
                push_word(&mut out, WORDS[rng.below(w)]);
                used += 1;
                sentence += 1;
            }
            out.push('.');
            out
        })
        .collect()
}

fn push_word(out: &mut String, word: &str) {
    if !out.is_empty() {
        out.push(' ');
    }
    out.push_str(word);
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn words_are_distinct() {
        let set: HashSet<&str> = WORDS.iter().copied().collect();
        let dup: Vec<&str> = WORDS.iter().copied().filter(|w| WORDS.iter().filter(|x| *x == w).count() > 1).collect();
        assert_eq!(set.len(), WORDS.len(), "duplicates: {dup:?}");
    }

    #[test]
    fn prompts_are_unique_from_their_first_words() {
        for n in [1, 32, 256, 257, 1000] {
            let p = generate(n, 20, 9);
            let firsts: HashSet<String> = p
                .iter()
                .map(|s| s.split(' ').take(if n > 256 { 2 } else { 1 }).collect::<Vec<_>>().join(" "))
                .collect();
            assert_eq!(firsts.len(), n, "{n} prompts");
        }
    }

    #[test]
    fn prompts_are_reproducible_per_seed() {
        assert_eq!(generate(8, 50, 1), generate(8, 50, 1));
        assert_ne!(generate(8, 50, 1), generate(8, 50, 2));
    }

    #[test]
    fn prompts_have_about_the_length_asked_for() {
        for p in generate(16, 235, 3) {
            let words = p.split(' ').count();
            let stops = p.matches('.').count();
            assert_eq!(words + stops, 235, "{p}");
        }
        assert_eq!(generate(1, 1, 0), ["time."]);
    }
}
