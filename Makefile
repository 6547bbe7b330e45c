# Two commands on a fresh machine with Python 3.11+ and make:
#   make run    start the whole system (embedded PostgreSQL unless DATABASE_URL is set)
#   make test   run the test suite against real PostgreSQL and real processes
# With nginx and its JavaScript module installed (apt-get install nginx libnginx-mod-http-js), docs/chaos.md:
#   make cluster REPLICAS=3   the system with N API replicas and two workers behind nginx
#   make soak                 a seeded chaos run through nginx, with payment batches over three NATS nodes, audited three ways
# With etcd and HAProxy too (apt-get install etcd-server haproxy), docs/failover.md:
#   make cluster-ha           the same on three PostgreSQL nodes under Patroni that fail over by themselves
#   make soak-ha              the soak, killing, freezing, cutting off and switching over the primary

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install run cluster cluster-ha soak soak-ha test test-batches test-batches-1000 mutants bench bench-batch bench-rate bench-outbox bench-watching bench-shares bench-explain bench-db-parts bench-instructions bench-webhook-instructions bench-server-instructions bench-served-instructions bench-growth bench-before-after screenshots lock clean demo-crash demo-crash-all demo-client-bug demo-reconcile demo-naive-crash demo-redis-window demo-webhooks demo-return demo-refund-race

install: $(STAMP)

# Re-installs whenever the dependencies change; the lock pins every package.
$(STAMP): pyproject.toml requirements.lock
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
	  || { echo "Python 3.11 or newer is needed (PYTHON=$(PYTHON))"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.lock
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/python -m devtools.run

# nginx is the distribution's package; without it, say how to get it.
REPLICAS ?= 3
NGINX_CHECK = @{ command -v nginx >/dev/null 2>&1 || test -x /usr/sbin/nginx; } \
	  && test -e /usr/lib/nginx/modules/ngx_http_js_module.so \
	  || { echo "nginx and its JavaScript module are needed: apt-get install nginx libnginx-mod-http-js"; exit 2; }

cluster: $(STAMP)
	$(NGINX_CHECK)
	$(BIN)/python -m devtools.cluster --replicas $(REPLICAS)

# A seeded chaos run (docs/chaos.md); non-zero exit on any violation. With payment batches over a
# three-node NATS cluster by default: BATCH_FILES files of BATCH_ROWS rows per run (3 and 60;
# BATCH_ROWS=0: none, and no NATS).
SEED     ?= 1
PAYMENTS ?= 300
SECONDS  ?= 60
SOAK_BATCHES = $(if $(filter command line environment,$(origin BATCH_ROWS)),--batch-rows $(BATCH_ROWS)) \
	$(if $(BATCH_FILES),--batch-files $(BATCH_FILES))
soak: $(STAMP)
	$(NGINX_CHECK)
	$(BIN)/python -m devtools.soak --seed $(SEED) --payments $(PAYMENTS) --seconds $(SECONDS) --replicas $(REPLICAS) \
	  $(SOAK_BATCHES)

# The HA cluster's programs (docs/failover.md): etcd and HAProxy from the distribution, Patroni from
# PyPI in a virtualenv of its own (requirements-ha.txt), so make install and make test never need it.
# As root Patroni runs as the embedded server's unprivileged user, who must be able to run its
# interpreter: the distribution's python3 then, not one under /root.
HA_VENV   := .venv-ha
HA_STAMP  := $(HA_VENV)/.installed
HA_PYTHON ?= $(shell test "$$(id -u)" = 0 && test -x /usr/bin/python3 && echo /usr/bin/python3 || echo $(PYTHON))
HA_CHECK = @{ command -v etcd >/dev/null 2>&1 && { command -v haproxy >/dev/null 2>&1 || test -x /usr/sbin/haproxy; }; } \
	  || { echo "etcd and HAProxy are needed: apt-get install etcd-server haproxy"; exit 2; }

$(HA_STAMP): requirements-ha.txt
	test -x $(HA_VENV)/bin/python || $(HA_PYTHON) -m venv $(HA_VENV)
	$(HA_VENV)/bin/python -m pip install --quiet -r requirements-ha.txt
	touch $(HA_STAMP)

HA_BASE_PORT ?= 0
cluster-ha: $(STAMP) $(HA_STAMP)
	$(NGINX_CHECK)
	$(HA_CHECK)
	$(BIN)/python -m devtools.cluster_ha --replicas $(REPLICAS) --base-port $(HA_BASE_PORT)

# The chaos soak on the HA cluster (docs/failover.md#the-soak-make-soak-ha); non-zero exit on any violation.
# Two primaries killed, a switchover, a stall past the TTL, both standbys stopped and, as root with
# iproute2's `ip`, a partition (each node in a network namespace of its own, the primary's link cut
# and restored; without them it says so and skips it): about 7 minutes. PAYMENTS and SECONDS
# are shared with `make soak`: here they default to 450 and 180 (the failovers need the time).
# SHORT=1: one primary kill, one switchover, both standbys stopped and the partition, 150 payments
# over 60 s: about 4 minutes (CI's).
# ASYNC_LAG=3: asynchronous replication instead, the standbys held 3 s behind before each of KILLS
# kills: what it loses (docs/failover.md#what-asynchronous-replication-costs; a report, exit 0).
KILLS ?= 2
ASYNC_LAG ?=
HA_SOAK_SIZE = $(if $(filter command line environment,$(origin PAYMENTS)),--payments $(PAYMENTS)) \
	$(if $(filter command line environment,$(origin SECONDS)),--seconds $(SECONDS))
soak-ha: $(STAMP) $(HA_STAMP)
	$(NGINX_CHECK)
	$(HA_CHECK)
	$(BIN)/python -m devtools.soak_ha --seed $(SEED) --replicas $(REPLICAS) --base-port $(HA_BASE_PORT) \
	  $(if $(SHORT),--short,$(HA_SOAK_SIZE) --kills $(KILLS)) $(if $(ASYNC_LAG),--async-lag $(ASYNC_LAG))

# Spread over TEST_WORKERS processes, each with a database and a stack of its
# own; `auto` is three, fewer if the server has too few connections for them
# (tests/conftest.py). TEST_WORKERS=0 runs every test in the one process.
TEST_WORKERS ?= auto
test: $(STAMP)
	$(BIN)/pytest -n $(TEST_WORKERS) --ignore=tests/batches

# Payment batches over a NATS server of each test's own (docs/batches.md): the
# consumers' crashes, the broker restarted, two consumers, dead letters.
# Real payments, several seconds each, so not in `make test`. The mid-batch
# kill with 1,000 rows instead of 50: `make test-batches-1000`.
# Two test workers by default: each test starts a broker and consumers of its own beside the stack.
BATCH_TEST_WORKERS ?= 2
test-batches: $(STAMP)
	$(BIN)/pytest -n $(BATCH_TEST_WORKERS) tests/batches

test-batches-1000: $(STAMP)
	BATCH_ROWS=1000 $(BIN)/pytest -p no:xdist tests/batches/test_batch_crashes.py -k mid_batch

# Deliberate bugs, one safety rule each, that the tests must catch
# (docs/crash-matrix.md#break-it-yourself); a few minutes.
mutants: $(STAMP)
	$(BIN)/python -m tests.mutants

bench: $(STAMP)
	$(BIN)/python -m bench.run

# Only the batch round (bench/batches.py): a 10,000-row batch over the broker, the time from upload to
# batch.completed, and rows/s beside HTTP new payments/s at the same moments (target 0.9x).
# BATCH_ROWS is shared with `make soak` (60 there): here it defaults to 10000.
bench-batch: $(STAMP)
	$(BIN)/python -m bench.batches $(if $(filter command line environment,$(origin BATCH_ROWS)),--rows $(BATCH_ROWS))

# Only the rounds that judge "faster than unsafe": phased and naive alternating, five rounds at 1 and 2
# workers, the rate as the median of the rounds' ratios and the service database's CPU per payment; then
# both at once (bench/rate_at_once.py, not judged): the same figures with the host's speed shared by both,
# each side's own fakes' CPU per payment, and how its calls arrive at its fake PSP.
bench-rate: $(STAMP)
	$(BIN)/python -m bench.run --rate-only

# Only the rounds that judge the outbox's cost: new payments with and without webhooks at once (bench/outbox.py),
# six rounds at 1 and 2 workers after a warm-up, the service's CPU per payment with ÷ without (target 1.05x).
bench-outbox: $(STAMP)
	$(BIN)/python -m bench.run --outbox-only

# Only the step that judges watching: at 1 and 2 workers, three pairs of APIs (metrics and logs on, off), each
# serving new payments at once, then replaying at once on one CPU; on ÷ off payments/s and replays/s (target 0.95x).
bench-watching: $(STAMP)
	$(BIN)/python -m bench.run --watching-only

# Only the API workers' shares (bench/shares.py): the watched API with 2 workers, 40 rounds of 5 s replays, each
# with fresh clients and a 3 s warm-up, and each worker's CPU, connections, answers and wait for a CPU in every
# round: 40 x 8 s of load after the start-up (docs/reference/performance.md#served-more-or-spent-more-an-answer-2026-12-06-night).
bench-shares: $(STAMP)
	$(BIN)/python -m bench.shares

# One new payment's every statement under EXPLAIN (ANALYZE, BUFFERS, WAL), phased and naive, on a PostgreSQL
# of the bench's own (docs/reference/performance.md#one-new-payment-in-the-database-statement-by-statement).
bench-explain: $(STAMP)
	$(BIN)/python -m bench.explain

# What each part of a new payment's SQL costs the database: pgbench of the recorded statements with one part
# taken out at a time (the lookup, the key row, the event, day partitions, the keys into payment, the payment's
# indexes but its primary key, its indexes before migration 0014), beside the naive twin's statements, and the
# server's CPU (and the part of it in the kernel) and WAL per payment of each
# (docs/reference/performance.md#what-each-part-of-a-payment-costs-the-database).
bench-db-parts: $(STAMP)
	$(BIN)/python -m bench.db_parts

# Figures the machine's noise does not move: the app's instructions per new payment and per replay under
# valgrind's callgrind, phased and naive, counted only in windows of 10 and 110 requests after a warm-up
# (no start-up, no server), each variant twice, and no figure unless the two agree within 1%; and the
# database's cost per statement from pg_stat_statements
# (docs/reference/performance.md#instructions-per-payment-and-the-databases-cost-per-statement).
# Needs valgrind (apt-get install valgrind) and a Python whose symbols are not stripped (a pyenv build is not).
# Four callgrind runs, all at once (each is one process; the counts do not depend on the CPU it gets):
# about 25 minutes on a busy 2-CPU machine, plus the statements' run.
bench-instructions: $(STAMP)
	$(BIN)/python -m bench.instructions --jobs 4

# The webhook dispatcher's instructions per first attempt, counted by callgrind in a window (needs valgrind)
bench-webhook-instructions: $(STAMP)
	$(BIN)/python -m bench.webhook_instructions

# The database server's instructions per new payment, the safe service's statements and the naive twin's,
# counted by callgrind in the server's backend, and split by the server's own functions (needs valgrind)
# (docs/reference/performance.md#where-the-databases-instructions-go-2026-12-03). About a minute.
bench-server-instructions: $(STAMP)
	$(BIN)/python -m bench.server_instructions

# A replay's instructions in the whole API process as uvicorn serves it, watched and unwatched: `payments api`
# under callgrind, windows zeroed and dumped from outside by callgrind_control (needs valgrind)
# (docs/reference/performance.md#what-watching-costs-a-replay-in-the-whole-process-2026-12-06-afternoon).
# About 11 minutes on a 2-CPU machine; --cache-sim, about 16.
bench-served-instructions: $(STAMP)
	$(BIN)/python -m bench.served_instructions

# The console's and /docs' pictures in docs/images/, made again from nothing
# with the distribution's headless Chromium (apt-get install chromium chromium-driver).
screenshots: $(STAMP)
	$(BIN)/python -m devtools.screenshots

# The API on an empty key table vs one preloaded to each size, side by side,
# then one day dropped by the reaper vs the same rows DELETEd
# (docs/reference/performance.md#the-key-table-at-10-million). The default took
# 50 minutes and 20 GB of disk on a busy 2-CPU machine; a short one (3 minutes):
#   make bench-growth ROWS=20000,100000 SECONDS=5 ROUNDS=1 DAY_ROWS=20000
# SECONDS is shared with `make soak` (default 60 there): here it defaults to 20.
# KEEP=1 keeps the bench's databases afterwards (they are dropped otherwise).
ROWS     ?= 1000000,10000000
ROUNDS   ?= 3
DAY_ROWS ?= 1000000
GROWTH_SECONDS = $(if $(filter command line environment,$(origin SECONDS)),$(SECONDS),20)
bench-growth: $(STAMP)
	$(BIN)/python -m bench.growth --rows $(ROWS) --seconds $(GROWTH_SECONDS) --rounds $(ROUNDS) --day-rows $(DAY_ROWS) \
	  $(if $(KEEP),--keep)

# This tree's API beside BASELINE's (a checkout of an earlier commit), at once on one CPU: the API's CPU
# per new payment and per replay, after ÷ before (docs/reference/performance.md#before-and-after-the-machine-refactor).
#   make bench-before-after BASELINE=../baseline [ROUNDS=6] [SECONDS=10]
# ROUNDS and SECONDS are shared with other targets: here they default to 6 and 10.
BASELINE ?=
BEFORE_AFTER_ROUNDS  = $(if $(filter command line environment,$(origin ROUNDS)),$(ROUNDS),6)
BEFORE_AFTER_SECONDS = $(if $(filter command line environment,$(origin SECONDS)),$(SECONDS),10)
bench-before-after: $(STAMP)
	@if [ -z "$(BASELINE)" ]; then \
	  echo "usage: make bench-before-after BASELINE=<a checkout of the code before> [ROUNDS=6] [SECONDS=10]"; \
	  exit 2; \
	fi
	$(BIN)/python -m bench.before_after --baseline "$(BASELINE)" --rounds $(BEFORE_AFTER_ROUNDS) \
	  --seconds $(BEFORE_AFTER_SECONDS)

# Kill-between-phases demos (docs/reference/client.md): real processes on free ports, in a
# database of their own (payments_demo), so they run alongside `make run`.
#   make demo-crash POINT=after-call-EXT1 [MODE=retry|worker]
POINT ?=
MODE  ?= retry

demo-crash: $(STAMP)
	@if [ -z "$(POINT)" ]; then \
	  echo "usage: make demo-crash POINT=<point> [MODE=retry|worker]; the points:"; \
	  $(BIN)/payments crash-points --explain; \
	  exit 2; \
	fi
	$(BIN)/python -m demos.crash --point "$(POINT)" --mode "$(MODE)"

demo-crash-all: $(STAMP)
	$(BIN)/python -m demos.crash_all --mode "$(MODE)"

demo-naive-crash: $(STAMP)
	$(BIN)/python -m demos.naive_crash

# THE REDIS TWIN (keys in Redis, payments in PostgreSQL) killed between the two writes pays twice;
# the service killed after the same commit, once (docs/naive-vs-safe.md#the-redis-window).
demo-redis-window: $(STAMP)
	$(BIN)/python -m demos.redis_window

demo-client-bug: $(STAMP)
	$(BIN)/python -m demos.client_bug

# Indeterminate payouts on a legacy rail, settled by `payments reconcile` (docs/reconciliation.md).
demo-reconcile: $(STAMP)
	$(BIN)/python -m demos.reconcile

# A payment's webhook, the dispatcher killed mid-delivery, the merchant's inbox applying it once (docs/outbox-inbox.md).
demo-webhooks: $(STAMP)
	$(BIN)/python -m demos.webhooks

# A payout returned days later: the rail's duplicate notification dropped by our inbox, the refund, the merchant's webhooks.
demo-return: $(STAMP)
	$(BIN)/python -m demos.returns

# Fifty refunds of one payment at once over two API processes, the PSP's own guard off: never past the charge.
demo-refund-race: $(STAMP)
	$(BIN)/python -m demos.refund_race

# Re-pin every dependency after editing pyproject.toml.
lock: $(STAMP)
	$(BIN)/python -m pip install --quiet uv==0.13.8
	$(BIN)/uv pip compile pyproject.toml --extra dev --python-version 3.11 -o requirements.lock

clean:
	rm -rf $(VENV) $(HA_VENV) *.egg-info
	@echo "kept .data/ (the embedded database); remove it yourself to start from nothing"
