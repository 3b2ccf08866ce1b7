# The NixOS module, evaluated with nixpkgs' lib.evalModules and stand-in
# declarations for the NixOS options it sets, which are:
#   assertions, warnings, environment.systemPackages, environment.etc,
#   systemd.sockets, systemd.services, systemd.user.services, programs.git.
# The stand-ins use NixOS's types for those options (unit options, etc
# entries) as self-written declarations, so a misspelt or mistyped
# definition fails here as it would on NixOS; that the options exist with
# these types in nixpkgs is what checks.vm proves on a machine that can
# build it.
#
#   nix-instantiate --eval --strict --json --read-write-mode nix/tests/eval-nixos.nix \
#     --arg libTree ../shared/third_party/nixpkgs-lib --argstr configJSON '{"enable": true}'
{
  libTree,
  configJSON ? ''{"enable": true}'',
}:
let
  lib = import (libTree + "/lib");
  inherit (lib) mkOption types;
  pkgs = import ./stubs.nix { inherit lib libTree; };

  atom = types.nullOr (types.oneOf [ types.bool types.int types.float types.str types.path types.package ]);
  unitOption = types.oneOf [ atom (types.listOf atom) ] // {
    description = "systemd unit option";
  };
  units = types.listOf types.str;
  unitType =
    extra:
    types.attrsOf (
      types.submodule {
        options = {
          description = mkOption { type = types.str; default = ""; };
          documentation = mkOption { type = units; default = [ ]; };
          wantedBy = mkOption { type = units; default = [ ]; };
          requires = mkOption { type = units; default = [ ]; };
          after = mkOption { type = units; default = [ ]; };
          unitConfig = mkOption { type = types.attrsOf unitOption; default = { }; };
          environment = mkOption {
            type = types.attrsOf (types.nullOr (types.oneOf [ types.str types.path types.package ]));
            default = { };
          };
        }
        // extra;
      }
    );
  serviceOptions = {
    serviceConfig = mkOption { type = types.attrsOf unitOption; default = { }; };
  };
  socketOptions = {
    listenStreams = mkOption { type = units; default = [ ]; };
    socketConfig = mkOption { type = types.attrsOf unitOption; default = { }; };
  };

  standIns = {
    options = {
      assertions = mkOption {
        type = types.listOf (types.submodule {
          options.assertion = mkOption { type = types.bool; };
          options.message = mkOption { type = types.str; };
        });
        default = [ ];
      };
      warnings = mkOption { type = types.listOf types.str; default = [ ]; };
      environment.systemPackages = mkOption { type = types.listOf types.package; default = [ ]; };
      environment.etc = mkOption {
        type = types.attrsOf (types.submodule {
          options.source = mkOption { type = types.nullOr types.path; default = null; };
          options.text = mkOption { type = types.nullOr types.lines; default = null; };
        });
        default = { };
      };
      systemd.services = mkOption { type = unitType serviceOptions; default = { }; };
      systemd.sockets = mkOption { type = unitType socketOptions; default = { }; };
      systemd.user.services = mkOption { type = unitType serviceOptions; default = { }; };
      programs.git = {
        enable = mkOption { type = types.bool; default = false; };
        config = mkOption { type = types.attrsOf types.anything; default = { }; };
      };
    };
  };

  evaluated = lib.evalModules {
    modules = [
      standIns
      ../nixos-module.nix
      { _module.args.pkgs = pkgs; }
      { services.agentsandbox = { package = pkgs.agentsandbox; } // builtins.fromJSON configJSON; }
    ];
  };
  inherit (evaluated) config;

  drv = import ./drv.nix { inherit lib; };
in
{
  failedAssertions = map (a: a.message) (lib.filter (a: !a.assertion) config.assertions);
  inherit (config) warnings;
  package = pkgs.agentsandbox.outPath;
  systemPackages = map (p: p.outPath) config.environment.systemPackages;
  etc = lib.mapAttrs (_: e: { source = drv e.source; inherit (e) text; }) config.environment.etc;
  sockets = config.systemd.sockets;
  services = config.systemd.services;
  userServices = config.systemd.user.services;
  git = config.programs.git;
  coreutils = pkgs.coreutils.outPath;
}
