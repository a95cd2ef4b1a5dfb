"""Weight updates (UpdateWeights, LoadWeights): assemble, check, stage, then swap at once.

One update of one model:
  header   the model's update slot is taken (one update per model at a time; another is ABORTED),
           the new version checked (above the live one; 0 means live + 1)
  tensors  each tensor's name, dtype and shape are checked against the live weight at its first
           piece (INVALID_ARGUMENT naming it); each piece, checked to come in order and fit, is
           written on a receiving thread straight to where the tensor is staged (on the device
           while ``staging_reserve_bytes`` stay free there, else in host memory), overlapping the
           reception of the next pieces; once complete the tensor is digested (queued), and
           probed for NaN and infinities (``check_finite_weights``)
  commit   the tensor count is checked, and for a full update that every weight came; the
           digests are read back (a tensor holding a NaN or an infinity is INVALID_ARGUMENT);
           then the scheduler swaps the staged tensors in between two micro-batches, and the
           version and fingerprint go live with them
Anything that fails before the swap (a bad tensor, a stream that ends or breaks before its
commit, a cancelled call) drops the staged tensors: the live weights and version are untouched.
LoadWeights reads only regular files, each checked after its symlinks are followed
(``files.safetensors_files``).

An update may come over several streams at once (``UpdateHeader.streams``): they join one
``Session`` by its ``update_id``, each carries its own tensors and commit, and the update goes
live when the last commits; every stream is answered with the same outcome, and a failure of any
fails them all.

The rooms: ``assembly`` (one tensor's pieces), ``update`` (one update: checked, staged, dropped
when it fails), ``session`` (an update over several streams), ``updater`` (``WeightUpdater``: the
update slots, every way an update comes, the swap), ``files`` (the files LoadWeights may read).
The messages they take are ``domain``'s (``UpdateHeader``, ``TensorPiece``, ...).

Nothing here sees protobuf (``api.wire`` turns the stream's messages into ``domain``'s objects) or
a tensor (``Staging``, ``worker.staging``, makes and stages them).
"""
