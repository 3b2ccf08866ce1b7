# The systemd units shipped in agentsandbox/data/ are the contract (see the
# brief's CONTRACTS and docs/service.md); the modules read them instead of
# restating their directives, so a hardening line added there reaches NixOS
# and home-manager without anyone copying it.  Only paths that must change on
# Nix (/usr/bin, /bin/kill, /usr/share/doc) are substituted.
{ lib }:
let
  inherit (lib)
    foldl'
    hasPrefix
    splitString
    replaceStrings
    mapAttrs
    ;

  strip =
    s:
    let
      m = builtins.match "[[:space:]]*(.*[^[:space:]])[[:space:]]*" s;
    in
    if m == null then "" else builtins.head m;

  # INI as systemd writes it: [Section], Key=Value, '#'/';' comments.  A key
  # given more than once becomes a list, which NixOS and home-manager render
  # back as repeated lines (the order systemd needs for SystemCallFilter=).
  parse =
    name: text:
    let
      step =
        state: raw:
        let
          line = strip raw;
          section = builtins.match "[[]([A-Za-z]+)[]]" line;
          kv = builtins.match "([A-Za-z0-9]+)=(.*)" line;
        in
        if line == "" || hasPrefix "#" line || hasPrefix ";" line then
          state
        else if lib.hasSuffix "\\" line then
          throw "${name}: continuation lines are not supported by nix/units.nix: ${line}"
        else if section != null then
          state // { current = builtins.head section; }
        else if kv != null && state.current != null then
          let
            key = builtins.elemAt kv 0;
            value = strip (builtins.elemAt kv 1);
            sec = state.sections.${state.current} or { };
          in
          state
          // {
            sections = state.sections // {
              ${state.current} = sec // {
                ${key} = (sec.${key} or [ ]) ++ [ value ];
              };
            };
          }
        else
          throw "${name}: cannot read this line: ${line}";
      result = foldl' step {
        current = null;
        sections = { };
      } (splitString "\n" text);
    in
    mapAttrs (_: mapAttrs (_: vs: if builtins.length vs == 1 then builtins.head vs else vs)) result.sections;

  read = file: parse (baseNameOf file) (builtins.readFile file);

  data = ../agentsandbox/data;
in
{
  inherit parse read;

  dispatchService = read (data + "/agentsandbox-dispatch.service");
  dispatchSocket = read (data + "/agentsandbox-dispatch.socket");
  userService = read (data + "/agentsandbox.service");

  # Store paths for the paths the shipped units name.
  substitute =
    { package, kill }:
    let
      f = replaceStrings
        [ "/usr/bin/" "/bin/kill " "file:///usr/share/doc/agentsandbox/" ]
        [ "${package}/bin/" "${kill} " "file://${package}/share/doc/agentsandbox/" ];
    in
    v: if builtins.isList v then map f v else f v;

  # "K=V" lines of Environment= as an attribute set.
  environment =
    v:
    let
      pairs = map (e: builtins.match "([^=]+)=(.*)" e) (lib.toList v);
    in
    builtins.listToAttrs (map (p: lib.nameValuePair (builtins.elemAt p 0) (builtins.elemAt p 1)) pairs);
}
