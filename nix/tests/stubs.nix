# Stand-ins for the parts of nixpkgs' package set the modules touch, so the
# modules evaluate with nixpkgs' lib alone (there is no package tree here).
# Self-written; nothing in it is nixpkgs' or home-manager's code.
#
# A stand-in derivation is an attribute set with type = "derivation" whose
# store path is not what nixpkgs would build; the tests map those paths to
# real files.  The two
# builders the modules call keep what they were given:
#   formats.toml.generate -> `value` (the tests write it as TOML and hand it
#                            to the real loader)
#   runCommand            -> `env` and `script` (the tests run the script,
#                            with this checkout's console scripts standing
#                            where the package's store path was)
#   writeTextFile         -> a real store file with the text (home-manager's
#                            rendered unit file)
{ lib, libTree, system ? "x86_64-linux" }:
let
  # The store path is a real (tiny) store file holding what the builder was
  # given, because home-manager copies a file's source with builtins.path
  # and that needs the path to exist (--read-write-mode).
  fakeDrv =
    name: extra:
    {
      type = "derivation";
      inherit name;
      outPath = builtins.toFile name (builtins.toJSON extra);
      stub = true;
    }
    // extra;

  program = pname: fakeDrv "${pname}-0" { inherit pname; meta.mainProgram = pname; };

  # The value type of (pkgs.formats.toml { }).type: what TOML can hold.
  tomlValue =
    let
      atom = lib.types.oneOf [ lib.types.bool lib.types.int lib.types.float lib.types.str lib.types.path ];
    in
    lib.types.nullOr (lib.types.oneOf [ atom (lib.types.listOf tomlValue) (lib.types.attrsOf tomlValue) ]) // {
      description = "TOML value";
    };
in
rec {
  inherit lib fakeDrv;
  path = libTree;
  stdenv.hostPlatform = lib.systems.elaborate system;

  formats.toml = _: {
    type = lib.types.attrsOf tomlValue;
    generate = name: value: fakeDrv name { inherit value; };
  };

  # home-manager renders unit files through it; `value` is the unit's sections.
  formats.ini = _: {
    type = lib.types.attrsOf (lib.types.attrsOf tomlValue);
    generate = name: value: fakeDrv name { inherit value; };
  };

  runCommand = name: env: script: fakeDrv name { inherit env script; };

  # home-manager writes unit files with it and names `outPath + destination`,
  # so the text goes into a real store file (builtins.toFile, which needs
  # --read-write-mode) that the tests read back: the unit file as written.
  writeTextFile = { name, text, ... }: {
    type = "derivation";
    inherit name text;
    outPath = builtins.toFile name text;
  };

  coreutils = program "coreutils";
  diffutils = program "diffutils";
  git = program "git";
  gnupg = program "gnupg";
  openssh = program "openssh";
  gh = program "gh";
  jq = program "jq";
  # Read by home-manager's core (i18n) when xdg.configFile is listed.
  glibcLocales = fakeDrv "glibc-locales-2.40" { version = "2.40"; };

  # The package: only its store path matters to the modules, which name its
  # bin/agentsandbox, bin/agentsandbox-twistd, bin/agentsandbox-policy-helper
  # (the drop-in's policy helper) and the signing wrappers under it.  The
  # tests stand a directory with pyproject.toml's console scripts there.
  agentsandbox = fakeDrv "agentsandbox-0.1.0" {
    pname = "agentsandbox";
    version = "0.1.0";
    meta.mainProgram = "agentsandbox";
  };
}
