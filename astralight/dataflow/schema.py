"""The dataflow state's SQLite tables (:data:`SCHEMA`) and the columns added to them after release
(:data:`MIGRATIONS`), which :class:`~astralight.dataflow.store.Store` creates and brings up to
date when it opens a state folder."""

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS instances (
    instance_id TEXT PRIMARY KEY, model_ids TEXT NOT NULL, capacity INTEGER NOT NULL,
    meta TEXT NOT NULL, registered_at REAL NOT NULL, last_seen REAL NOT NULL,
    tasks_leased INTEGER NOT NULL DEFAULT 0, samples_pushed INTEGER NOT NULL DEFAULT 0,
    capacity_units REAL NOT NULL DEFAULT 1.0, state TEXT NOT NULL DEFAULT 'active', left_at REAL,
    alive_prior_s REAL NOT NULL DEFAULT 0, tasks_done INTEGER NOT NULL DEFAULT 0,
    tasks_failed INTEGER NOT NULL DEFAULT 0, tasks_returned INTEGER NOT NULL DEFAULT 0,
    fail_streak INTEGER NOT NULL DEFAULT 0, busy_s REAL NOT NULL DEFAULT 0,
    tasks_timed INTEGER NOT NULL DEFAULT 0, reported_in_flight INTEGER, limits TEXT);
CREATE TABLE IF NOT EXISTS tasks (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, task_id TEXT NOT NULL UNIQUE, kind TEXT NOT NULL,
    model_ids TEXT NOT NULL, target_model TEXT, eval_version INTEGER, prompt_index INTEGER,
    payload BLOB NOT NULL, state TEXT NOT NULL, instance_id TEXT, deadline REAL,
    lease_count INTEGER NOT NULL DEFAULT 0, created REAL NOT NULL, done_at REAL, leased_at REAL);
CREATE INDEX IF NOT EXISTS tasks_open ON tasks(kind, state, seq);
CREATE INDEX IF NOT EXISTS tasks_held ON tasks(state, instance_id, deadline);
CREATE TABLE IF NOT EXISTS samples (
    id INTEGER PRIMARY KEY AUTOINCREMENT, task_id TEXT NOT NULL, model_id TEXT NOT NULL,
    sample_index INTEGER NOT NULL, min_version INTEGER NOT NULL, reward REAL NOT NULL,
    state TEXT NOT NULL, batch_id TEXT, blob BLOB NOT NULL, created REAL NOT NULL,
    UNIQUE(task_id, model_id, sample_index));
CREATE INDEX IF NOT EXISTS samples_state ON samples(state, model_id, id);
CREATE INDEX IF NOT EXISTS samples_batch ON samples(batch_id);
CREATE TABLE IF NOT EXISTS batches (
    batch_id TEXT PRIMARY KEY, model_id TEXT NOT NULL, trainer_id TEXT,
    policy_version INTEGER NOT NULL, n INTEGER NOT NULL, state TEXT NOT NULL,
    served_at REAL NOT NULL, acked_at REAL, renewed_at REAL, acked_step INTEGER,
    rolled_back_at REAL);
CREATE INDEX IF NOT EXISTS batches_state ON batches(state, served_at);
CREATE TABLE IF NOT EXISTS versions (
    model_id TEXT NOT NULL, version INTEGER NOT NULL, manifest BLOB NOT NULL,
    published_at REAL NOT NULL, PRIMARY KEY(model_id, version));
CREATE TABLE IF NOT EXISTS version_times (
    model_id TEXT NOT NULL, version INTEGER NOT NULL, published_at REAL NOT NULL,
    PRIMARY KEY(model_id, version));
CREATE TABLE IF NOT EXISTS eval_runs (
    model_id TEXT NOT NULL, version INTEGER NOT NULL, n_prompts INTEGER NOT NULL,
    k INTEGER NOT NULL, scheduled_at REAL NOT NULL, n INTEGER, pass_k TEXT,
    PRIMARY KEY(model_id, version));
CREATE TABLE IF NOT EXISTS eval_reports (
    model_id TEXT NOT NULL, version INTEGER NOT NULL, prompt_index INTEGER NOT NULL,
    task_id TEXT NOT NULL, n_samples INTEGER NOT NULL, n_correct INTEGER NOT NULL,
    sum_reward REAL NOT NULL, min_version INTEGER, max_version INTEGER,
    reported_at REAL NOT NULL, n_team_correct INTEGER, n_tool_calling INTEGER,
    PRIMARY KEY(model_id, version, prompt_index));
CREATE TABLE IF NOT EXISTS counters (
    model_id TEXT NOT NULL, name TEXT NOT NULL, value INTEGER NOT NULL,
    PRIMARY KEY(model_id, name));
CREATE TABLE IF NOT EXISTS version_counters (
    model_id TEXT NOT NULL, version INTEGER NOT NULL, name TEXT NOT NULL, value INTEGER NOT NULL,
    PRIMARY KEY(model_id, version, name));
CREATE TABLE IF NOT EXISTS replays (
    batch_id TEXT NOT NULL, sample_id INTEGER NOT NULL, state TEXT NOT NULL,
    PRIMARY KEY(batch_id, sample_id));
CREATE INDEX IF NOT EXISTS replays_sample ON replays(sample_id);
CREATE TABLE IF NOT EXISTS plugin_state (
    name TEXT PRIMARY KEY, class_path TEXT NOT NULL, state TEXT NOT NULL, saved_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS plugin_journal (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL, data TEXT NOT NULL);
"""

#: ``{table: [(column, declaration)]}`` added after release; :meth:`~astralight.dataflow.store.Store._migrate` adds the
#: ones an older state folder lacks (the CREATE TABLE statements above already have them)
MIGRATIONS = {
    # n_tool_calling: first-attempt samples whose episode called a tool (NULL: no tool workflow)
    "eval_reports": [("n_team_correct", "INTEGER"), ("n_tool_calling", "INTEGER")],
    # samples per eval prompt (NULL: k, a state written without the column) and the pass@k k values as a
    # JSON list (NULL: [k])
    "eval_runs": [("n", "INTEGER"), ("pass_k", "TEXT")],
    "instances": [("capacity_units", "REAL NOT NULL DEFAULT 1.0"),
                  ("state", "TEXT NOT NULL DEFAULT 'active'"), ("left_at", "REAL"),
                  ("alive_prior_s", "REAL NOT NULL DEFAULT 0"),
                  ("tasks_done", "INTEGER NOT NULL DEFAULT 0"),
                  ("tasks_failed", "INTEGER NOT NULL DEFAULT 0"),
                  ("tasks_returned", "INTEGER NOT NULL DEFAULT 0"),
                  ("fail_streak", "INTEGER NOT NULL DEFAULT 0"),
                  ("busy_s", "REAL NOT NULL DEFAULT 0"),
                  ("tasks_timed", "INTEGER NOT NULL DEFAULT 0"),
                  ("reported_in_flight", "INTEGER"),
                  # what the instance's engines said at registration, per model_id (JSON
                  # {model_id: {vocab_size, max_model_len}}; NULL: nothing said)
                  ("limits", "TEXT")],
    "tasks": [("leased_at", "REAL")],
    # last keep-alive of a served batch (POST /v1/batches/extend); NULL: never extended
    "batches": [("renewed_at", "REAL"), ("acked_step", "INTEGER"), ("rolled_back_at", "REAL")],
}
