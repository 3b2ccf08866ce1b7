# A stand-in derivation as JSON: its path, and what its builder was given
# (a derivation among runCommand's env attributes, as the same JSON).
# (Not outPath: toJSON would print an attribute set that has one as the path alone.)
{ lib }:
let
  drv =
    d:
    if builtins.isAttrs d then
      { path = d.outPath; }
      // lib.optionalAttrs (d ? value) { inherit (d) value; }
      // lib.optionalAttrs (d ? script) { inherit (d) script; }
      // lib.optionalAttrs (d ? text) { inherit (d) text; }
      // lib.optionalAttrs (d ? env) { env = lib.mapAttrs (_: v: if lib.isDerivation v then drv v else v) d.env; }
    else
      d;
in
drv
