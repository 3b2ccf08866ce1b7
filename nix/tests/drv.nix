# A stand-in derivation as JSON: its path, and what its builder was given.
# (Not outPath: toJSON would print an attribute set that has one as the path alone.)
{ lib }:
d:
if builtins.isAttrs d then
  { path = d.outPath; }
  // lib.optionalAttrs (d ? value) { inherit (d) value; }
  // lib.optionalAttrs (d ? script) { inherit (d) script; }
  // lib.optionalAttrs (d ? text) { inherit (d) text; }
else
  d
