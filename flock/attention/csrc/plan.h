// The step's segment table and merges in one call (flock_cpu_plan): the same arrays as segments.py's
// build_segments (its prefix groups by sharing.py's find_prefix_groups) and cpu.py's plan_segments make with numpy
// (no sliding window, no image spans), which stay the reference. One C call where numpy takes some hundred: after
// a decode step's weights have streamed through the caches, each of those calls runs several times slower than its
// arithmetic.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { PLAN_BLOCK, PLAN_GROUP_HEADS, PLAN_MIN_BLOCKS, PLAN_MAX_QUERY, PLAN_KV_HEADS, PLAN_THREADS, PLAN_UNIT_ROWS,
       PLAN_CHUNK, PLAN_MAX_PARTS, PLAN_CONFIG };
enum { SEG_PREFIX, SEG_PARTIAL, SEG_DIRECT };  // segments.py's PREFIX, PARTIAL, DIRECT

typedef struct {
    const int64_t *tables, *begin, *len;  // requests' block tables: tables[begin[i] ..][: len[i]]
} Keys;

// Whether request a's shareable blocks sort before b's: by their ids, a table that is the other's start first,
// then by request (a stable sort, as sharing.py's).
static int sorts_before(const Keys *k, int64_t a, int64_t b) {
    const int64_t *x = k->tables + k->begin[a], *y = k->tables + k->begin[b];
    const int64_t n = k->len[a] < k->len[b] ? k->len[a] : k->len[b];
    for (int64_t j = 0; j < n; j++)
        if (x[j] != y[j]) return x[j] < y[j];
    return k->len[a] != k->len[b] ? k->len[a] < k->len[b] : a < b;
}

static void merge_sort(const Keys *k, int64_t *rows, int64_t *tmp, int64_t n) {
    if (n < 2) return;
    const int64_t h = n / 2;
    merge_sort(k, rows, tmp, h);
    merge_sort(k, rows + h, tmp, n - h);
    int64_t i = 0, j = h, o = 0;
    while (i < h && j < n) tmp[o++] = sorts_before(k, rows[j], rows[i]) ? rows[j++] : rows[i++];
    while (i < h) tmp[o++] = rows[i++];
    while (j < n) tmp[o++] = rows[j++];
    memcpy(rows, tmp, (size_t)n * sizeof(int64_t));
}

typedef struct {
    int64_t first, members, blocks;  // a run of sorted rows and the leading blocks they share
} Group;

// sharing.py's _best: the grouping of sorted rows lo..hi that saves most prefix reads (lcp[j]: blocks rows j and
// j + 1 share), its groups appended at groups[*n]; returns the blocks it saves.
static int64_t best_groups(const int64_t *lcp, int64_t lo, int64_t hi, int64_t min_blocks, Group *groups,
                           int64_t *n) {
    if (lo >= hi) return 0;
    int64_t depth = lcp[lo];
    for (int64_t j = lo + 1; j < hi; j++) depth = lcp[j] < depth ? lcp[j] : depth;
    const int64_t whole = depth >= min_blocks ? (hi - lo) * depth : 0, mark = *n;
    int64_t saved = 0, start = lo;
    for (int64_t j = lo; j <= hi; j++)
        if (j == hi || lcp[j] == depth) {
            saved += best_groups(lcp, start, j, min_blocks, groups, n);
            start = j + 1;
        }
    if (whole > 0 && whole >= saved) {
        *n = mark;
        groups[(*n)++] = (Group){lo, hi - lo + 1, depth};
        return whole;
    }
    return saved;
}

// floor division, as Python's // (b > 0)
static inline int64_t floor_div(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

// Plans a step of num_req requests (query_start[num_req + 1], seq_lens, their block tables concatenated in tables,
// table_lens long) with config[PLAN_CONFIG] (max_query -1: no limit). Writes the pieces' segment rows segs[][7],
// the entries' tokens and positions, the tables as int32, and the merges (offsets, slots, tokens); sizes[] =
// {pieces, entries, slots, merged tokens}. The caller sizes the outputs by plan_bounds in cpu.py. Returns 0, or 1
// when memory ran out.
int flock_cpu_plan(const int64_t *query_start, const int64_t *seq_lens, const int64_t *table_lens,
                   const int64_t *tables, int64_t num_req, const int64_t *config, int32_t *segs, int32_t *tokens,
                   int32_t *positions, int32_t *tables32, int32_t *merge_offsets, int32_t *merge_slots,
                   int32_t *merge_tokens, int64_t *sizes) {
    const int64_t R = num_req, bs = config[PLAN_BLOCK], g = config[PLAN_GROUP_HEADS], T = query_start[R];
    const int64_t max_parts = config[PLAN_MAX_PARTS], chunk = config[PLAN_CHUNK];
    // per request: 0 qlen, 1 computed, 2 shareable, 3 table begin, 4 order, 5 sort scratch, 6 lcp, 7 in group,
    // 8 context start; per segment (at most 2R): 9 begin, 10 rows, 11 table, 12 kv start, 13 kv end, 14 kind,
    // 15 parts, 16 step
    int64_t *w = malloc(sizeof(int64_t) * (size_t)(9 * R + 16 * R + 8));
    Group *groups = malloc(sizeof(Group) * (size_t)(R + 1));
    if (!w || !groups) return free(w), free(groups), 1;
    int64_t *qlen = w, *computed = w + R, *shareable = w + 2 * R, *table_begin = w + 3 * R, *order = w + 4 * R;
    int64_t *tmp = w + 5 * R, *lcp = w + 6 * R, *in_group = w + 7 * R, *context = w + 8 * R;
    int64_t *s_begin = w + 9 * R, *s_rows = w + 11 * R, *s_table = w + 13 * R, *s_kv0 = w + 15 * R;
    int64_t *s_kv1 = w + 17 * R, *s_kind = w + 19 * R, *s_parts = w + 21 * R, *s_step = w + 23 * R;
    int64_t tb = 0;
    for (int64_t i = 0; i < R; i++) {
        qlen[i] = query_start[i + 1] - query_start[i];
        computed[i] = seq_lens[i] - qlen[i];
        const int takes = config[PLAN_MAX_QUERY] < 0 || qlen[i] <= config[PLAN_MAX_QUERY];
        shareable[i] = takes ? floor_div(computed[i], bs) : 0;
        table_begin[i] = tb, tb += table_lens[i];
        in_group[i] = 0, context[i] = 0;
    }
    for (int64_t j = 0; j < tb; j++) tables32[j] = (int32_t)tables[j];

    // prefix groups: the sharable rows sorted by their tables, runs of neighbours grouped (sharing.py)
    int64_t candidates = 0, num_groups = 0;
    for (int64_t i = 0; i < R; i++)
        if (shareable[i] >= config[PLAN_MIN_BLOCKS]) order[candidates++] = i;
    if (candidates >= 2) {
        const Keys keys = {tables, table_begin, shareable};
        merge_sort(&keys, order, tmp, candidates);
        for (int64_t j = 0; j + 1 < candidates; j++) {
            const int64_t a = order[j], b = order[j + 1];
            const int64_t n = shareable[a] < shareable[b] ? shareable[a] : shareable[b];
            int64_t d = 0;
            while (d < n && tables[table_begin[a] + d] == tables[table_begin[b] + d]) d++;
            lcp[j] = d;
        }
        best_groups(lcp, 0, candidates - 1, config[PLAN_MIN_BLOCKS], groups, &num_groups);
    }
    // the requests in segment order: the groups' members, then the others (segments.py)
    memcpy(tmp, order, sizeof(int64_t) * (size_t)candidates);
    int64_t n = 0;
    for (int64_t gi = 0; gi < num_groups; gi++)
        for (int64_t m = 0; m < groups[gi].members; m++) {
            const int64_t i = tmp[groups[gi].first + m];
            order[n++] = i, in_group[i] = 1, context[i] = groups[gi].blocks * bs;
        }
    const int64_t grouped = n;
    for (int64_t i = 0; i < R; i++)
        if (!in_group[i]) order[n++] = i;
    int64_t num_partial = 0;
    for (int64_t j = 0; j < grouped; j++) num_partial += qlen[order[j]];

    // segments: one per request, then one per group's prefix; entries: the grouped requests' tokens twice
    int64_t e = num_partial, at = 0;
    for (int64_t j = 0; j < R; j++) {
        const int64_t i = order[j];
        s_begin[j] = at + (j >= grouped ? num_partial : 0);
        s_rows[j] = qlen[i] * g, s_table[j] = table_begin[i], s_kv0[j] = context[i], s_kv1[j] = seq_lens[i];
        s_kind[j] = in_group[i] ? SEG_PARTIAL : SEG_DIRECT;
        for (int64_t t = 0; t < qlen[i]; t++, e++) {
            tokens[e] = (int32_t)(query_start[i] + t), positions[e] = (int32_t)(computed[i] + t);
            if (at + t < num_partial) tokens[at + t] = tokens[e], positions[at + t] = positions[e];
        }
        at += qlen[i];
    }
    const int64_t S = R + num_groups;
    for (int64_t gi = 0, begin = num_partial, j = 0; gi < num_groups; gi++) {
        int64_t q = 0;
        for (int64_t m = 0; m < groups[gi].members; m++) q += qlen[order[j + m]];
        const int64_t s = R + gi;
        s_begin[s] = begin, s_rows[s] = q * g, s_table[s] = table_begin[order[j]], s_kv0[s] = 0;
        s_kv1[s] = groups[gi].blocks * bs, s_kind[s] = SEG_PREFIX;
        begin += q, j += groups[gi].members;
    }

    // pieces: a segment whose one-KV-head unit holds more than half a thread's share split by KV range (cpu.py)
    int64_t work = 0;
    for (int64_t s = 0; s < S; s++) work += s_rows[s] * (s_kv1[s] - s_kv0[s]);
    const int64_t threads = config[PLAN_THREADS];
    const double share = (double)work * (double)config[PLAN_KV_HEADS] / (double)(threads > 1 ? threads : 1);
    int64_t pieces = 0;
    for (int64_t s = 0; s < S; s++) {
        const int64_t kv_len = s_kv1[s] - s_kv0[s];
        int64_t parts = 1;
        if (threads > 1 && share > 0) {
            const int64_t unit = (s_rows[s] < config[PLAN_UNIT_ROWS] ? s_rows[s] : config[PLAN_UNIT_ROWS]) * kv_len;
            const int64_t chunks = -floor_div(-kv_len, chunk), most = max_parts < chunks ? max_parts : chunks;
            double p = ceil((double)unit / (share / 2));
            p = p < 1 ? 1 : p;
            parts = (int64_t)(p > (double)most ? (double)most : p);
        }
        const int64_t m = parts > 1 ? parts : 1;
        s_step[s] = -floor_div(floor_div(-kv_len, m), chunk) * chunk;
        s_parts[s] = kv_len > 0 ? -floor_div(-kv_len, s_step[s] > 1 ? s_step[s] : 1) : 1;
        pieces += s_parts[s];
    }
    // each piece's row; fresh slots (beyond the grouped entries' two) for pieces after a segment's first and for
    // split direct segments; the token of every slot
    const int64_t base = 2 * num_partial;
    int64_t slot = base, p = 0;
    int32_t *slot_token = merge_tokens;  // (reordered into merge_tokens below, through merge_slots)
    for (int64_t j = 0; j < base; j++) slot_token[j] = tokens[j];
    for (int64_t s = 0; s < S; s++)
        for (int64_t index = 0; index < s_parts[s]; index++, p++) {
            const int64_t kv0 = s_kv0[s] + index * s_step[s], end = kv0 + s_step[s];
            const int fresh = index > 0 || (s_kind[s] == SEG_DIRECT && s_parts[s] > 1);
            int32_t *row = segs + 7 * p;
            row[0] = (int32_t)s_begin[s], row[1] = (int32_t)s_rows[s], row[2] = (int32_t)s_table[s];
            row[3] = (int32_t)kv0, row[4] = (int32_t)(end < s_kv1[s] ? end : s_kv1[s]);
            row[5] = s_kind[s] != SEG_PREFIX;
            row[6] = (int32_t)(fresh ? slot : s_kind[s] == SEG_DIRECT ? -1 : s_begin[s]);
            if (fresh)
                for (int64_t t = 0; t < s_rows[s] / g; t++) slot_token[slot++] = tokens[s_begin[s] + t];
        }
    // merges: the slots in token order (a stable counting sort), each token's first
    int64_t *count = calloc((size_t)(T + 1), sizeof(int64_t));
    if (!count) return free(w), free(groups), 1;
    for (int64_t j = 0; j < slot; j++) count[slot_token[j] + 1]++;
    for (int64_t t = 0; t < T; t++) count[t + 1] += count[t];
    for (int64_t j = 0; j < slot; j++) merge_slots[count[slot_token[j]]++] = (int32_t)j;
    int64_t merged = 0, last = -1;
    for (int64_t j = 0; j < slot; j++) {  // (count, done with, holds the merged tokens: slot_token is read here)
        const int32_t t = slot_token[merge_slots[j]];
        if (t != last) merge_offsets[merged] = (int32_t)j, count[merged++] = t, last = t;
    }
    merge_offsets[merged] = (int32_t)slot;
    for (int64_t j = 0; j < merged; j++) merge_tokens[j] = (int32_t)count[j];
    sizes[0] = pieces, sizes[1] = num_partial + T, sizes[2] = slot, sizes[3] = merged;
    free(count), free(w), free(groups);
    return 0;
}
