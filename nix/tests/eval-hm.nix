# The home-manager module, evaluated inside home-manager's real module set
# (modules/modules.nix, minimal = true, plus its real programs/git.nix) with
# nixpkgs' lib and the package stand-ins of stubs.nix.  Its own stand-ins are
# only for the two nixpkgs files home-manager imports from pkgs.path
# (nixos/modules/misc/assertions.nix and meta.nix): their options are declared
# here, and the files are left out of the list; and for programs.fish, which
# home-manager's autojump sets and the minimal list does not declare.
#
#   nix-instantiate --eval --strict --json --read-write-mode nix/tests/eval-hm.nix \
#     --arg libTree ../shared/third_party/nixpkgs-lib --arg hmTree ../shared/third_party/home-manager \
#     --argstr configJSON '{"enable": true}'
{
  libTree,
  hmTree,
  configJSON ? ''{"enable": true}'',
  user ? "alice",
  system ? "x86_64-linux",
}:
let
  lib = import (hmTree + "/modules/lib/stdlib-extended.nix") (import (libTree + "/lib"));
  inherit (lib) mkOption types;
  pkgs = import ./stubs.nix { inherit lib libTree system; };

  fromNixpkgs = m: builtins.isPath m && lib.hasInfix "/nixos/modules/misc/" (toString m);
  hmModules = builtins.filter (m: !(fromNixpkgs m)) (
    import (hmTree + "/modules/modules.nix") {
      inherit pkgs lib;
      minimal = true;
      useNixpkgsModule = false;
    }
  );

  standIns = {
    options.assertions = mkOption {
      type = types.listOf (types.submodule {
        options.assertion = mkOption { type = types.bool; };
        options.message = mkOption { type = types.str; };
      });
      default = [ ];
    };
    options.warnings = mkOption { type = types.listOf types.str; default = [ ]; };
    options.meta = mkOption { type = types.attrsOf types.raw; default = { }; };
    # Set by home-manager's autojump module, whose fish counterpart the minimal list omits.
    options.programs.fish = mkOption { type = types.attrsOf types.anything; default = { }; };
  };

  evaluated = lib.evalModules {
    class = "homeManager";
    specialArgs.modulesPath = hmTree + "/modules";
    modules = hmModules ++ [
      standIns
      (hmTree + "/modules/programs/git.nix")
      {
        home = {
          username = user;
          homeDirectory = "/home/${user}";
          stateVersion = "25.05";
        };
      }
      ../hm-module.nix
      { services.agentsandbox = { package = pkgs.agentsandbox; } // builtins.fromJSON configJSON; }
    ];
  };
  inherit (evaluated) config;
  drv = import ./drv.nix { inherit lib; };
  gitOption = if config.programs.git ? settings then "settings" else "extraConfig";
in
{
  failedAssertions = map (a: a.message) (lib.filter (a: !a.assertion) config.assertions);
  # home-manager's own modules warn about things this stand-in set leaves out;
  # ours all start with the module's name.
  warnings = lib.filter (lib.hasPrefix "services.agentsandbox") config.warnings;
  package = pkgs.agentsandbox.outPath;
  home = config.home.homeDirectory;
  # Only what this module adds: the rest of home.packages comes from
  # home-manager's core and would need its whole package set.
  homePackages = map (p: p.outPath) (
    lib.concatMap (d: d.value) (
      lib.filter (d: lib.hasSuffix "/nix/hm-module.nix" d.file) evaluated.options.home.packages.definitionsWithLocations
    )
  );
  configFile = lib.mapAttrs (_: f: { source = drv f.source; inherit (f) target; }) (
    lib.filterAttrs (n: _: lib.hasPrefix "agentsandbox/" n) config.xdg.configFile
  );
  dataFile = lib.mapAttrs (_: f: { source = drv f.source; inherit (f) target; }) (
    lib.filterAttrs (n: _: lib.hasPrefix "agentsandbox/" n) config.xdg.dataFile
  );
  activation = config.home.activation.agentsandboxDropIn.data or null;
  activationAfter = config.home.activation.agentsandboxDropIn.after or null;
  service = config.systemd.user.services.agentsandbox or null;
  # The file home-manager links to ~/.config/systemd/user/agentsandbox.service.
  unitFile =
    let
      source = config.xdg.configFile."systemd/user/agentsandbox.service".source;
    in
    if config.xdg.configFile ? "systemd/user/agentsandbox.service" then builtins.readFile (dirOf source) else null;
  git = (config.programs.git.${gitOption} or { }).gpg or null;
  coreutils = pkgs.coreutils.outPath;
  jq = pkgs.jq.outPath;
}
