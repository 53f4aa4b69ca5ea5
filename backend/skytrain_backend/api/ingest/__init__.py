"""Taking trajectories in: read, validate, summarise, serialise, store.

A bulk body (a training job, a log, an SFT job: tens of megabytes of trajectories) is never
turned into Python objects as a whole. Its bytes are spooled as they arrive (in memory up to
1 MiB, then in a temporary file); one pass of msgspec's C parser splits it into its small
fields and the raw bytes of each item of its list (``trajectory_groups``, ``trajectories``);
then each item is validated alone and written as one JSONL line, straight to the object store
(``IngestBatch.stream_to``) or to a spool. Items are decoded by msgspec into the Structs of
``api.trajectory_structs`` (and written back by msgspec's encoder); an item msgspec refuses is
validated by pydantic's models, which name the problem, or accept what msgspec's stricter
types did not. Either way the line stored is the model's ``model_dump_json``. Memory stays at
one item plus the buffers (spool, upload parts) whatever the size of the body, and the count
limit stops the work as soon as it is passed.

A batch is stored atomically from the client's point of view: on S3 a batch of up to 16 MiB
stored goes up in one PUT once everything is valid; a larger one goes up as it is validated,
as a multipart upload that becomes an object only then (and is aborted otherwise); then the
rows are inserted in one transaction; if the transaction fails the object is deleted again. A
rejected request leaves no row and no object behind.

One job per module; the routes (and ``bench/ingest_phases.py``) use the names below:

- ``body.py``: the request body spooled (``read_body``, ``Spool``), split in one pass
  (``split_body``, ``each_item``) and each item parsed (``parse_group``, ``parse_trajectory``);
- ``batch.py``: the JSONL the items become (``IngestBatch``), the trainability rule
  (``trainable_turns``), and the store-then-commit that keeps a batch atomic;
- ``summaries.py``: reward and metric summaries (``Summary``, ``summarize``, ``combine``) and
  the sequences longer than a job's row (``LongSequences``).
"""

from skytrain_backend.api.ingest.batch import (
    IngestBatch,
    groups_from_jsonl,
    parse_trajectory_lines,
    store_then_commit,
    trainable_turns,
)
from skytrain_backend.api.ingest.body import (
    Group,
    Spool,
    check_count,
    each_item,
    parse_group,
    parse_trajectory,
    read_body,
    split_body,
)
from skytrain_backend.api.ingest.summaries import LongSequences, Summary, combine, summarize

__all__ = [
    "Group",
    "IngestBatch",
    "LongSequences",
    "Spool",
    "Summary",
    "check_count",
    "combine",
    "each_item",
    "groups_from_jsonl",
    "parse_group",
    "parse_trajectory",
    "parse_trajectory_lines",
    "read_body",
    "split_body",
    "store_then_commit",
    "summarize",
    "trainable_turns",
]
