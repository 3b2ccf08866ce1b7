# services.agentsandbox for home-manager: one user's config, their systemd
# user service, and git's signing programs on request.
#
# No Claude Code drop-in: the one in /etc/claude-code serves every user of the
# machine, so it is rendered by root from the machine's config alone (the
# NixOS module, the .deb, or `sudo agentsandbox install`), never from a file
# a user can write.  It names agentsandbox's policy helper, which Claude Code
# runs as each session's user: that is how this user's config reaches their
# sessions.  The activation checks such a drop-in is there and names a helper
# that exists, and if not, prints the one root command that renders it.
#
# `services.` rather than `programs.`: home-manager names a module after the
# daemon it runs (services.gpg-agent, services.syncthing, services.spotifyd),
# and the heart of this one is the user service; the option names then match
# the NixOS module's, so a settings block moves between the two unchanged.
{
  config,
  lib,
  options,
  pkgs,
  ...
}:
let
  inherit (lib)
    mkEnableOption
    mkIf
    mkOption
    types
    toList
    optionalAttrs
    ;

  cfg = config.services.agentsandbox;
  settingsLib = import ./settings.nix { inherit lib; };
  units = import ./units.nix { inherit lib; };
  tomlFormat = pkgs.formats.toml { };

  settings = settingsLib.clean cfg.settings;
  generated = tomlFormat.generate "agentsandbox-config.toml" settings;
  # The same file, once the package's loader has taken it: a config it
  # refuses fails the build with the loader's own `KEY: WHY`, not the policy
  # helper at the next Claude Code start (which then does not start).  The
  # build has no machine config, so this checks the file itself; where
  # /etc/agentsandbox/config.toml exists it narrows the file at run time.
  configFile =
    pkgs.runCommand "agentsandbox-config.toml"
      {
        inherit generated;
        preferLocalBuild = true;
        allowSubstitutes = false;
      }
      ''
        export HOME="$TMPDIR/home" XDG_RUNTIME_DIR=/run/user/65534
        unset XDG_CONFIG_HOME XDG_STATE_HOME CLAUDE_CONFIG_DIR AGENTSANDBOX_CONFIG
        ${cfg.package}/bin/agentsandbox config --config "$generated" > /dev/null
        cp "$generated" "$out"
      '';

  home = config.home.homeDirectory;
  configTarget = "${config.xdg.configHome}/agentsandbox/config.toml";

  # Claude Code reads the .d directory only beside the base file.
  managedBase = "/etc/claude-code/managed-settings.json";
  managedTarget = "/etc/claude-code/managed-settings.d/50-agentsandbox.json";
  jq = lib.getExe pkgs.jq;
  # Renders from /etc/agentsandbox/config.toml, or the built-in defaults
  # without one; never from this user's file.
  installCommand = "sudo ${cfg.package}/bin/agentsandbox install";

  subst = units.substitute {
    package = cfg.package;
    kill = "${pkgs.coreutils}/bin/kill";
  };
  shipped = units.userService;

  servicePath = lib.concatStringsSep ":" [
    (lib.makeBinPath cfg.path)
    "${config.home.profileDirectory}/bin"
    "/run/wrappers/bin"
    "/etc/profiles/per-user/%u/bin"
    "/run/current-system/sw/bin"
    "/usr/local/bin"
    "/usr/bin"
    "/bin"
  ];

  signing = {
    gpg.program = "${cfg.package}/bin/agentsandbox-gpg";
    gpg.ssh.program = "${cfg.package}/bin/agentsandbox-ssh-sign";
  };
  # programs.git.extraConfig became programs.git.settings in home-manager 25.11.
  gitSettingsOption = if options.programs.git ? settings then "settings" else "extraConfig";
in
{
  options.services.agentsandbox = {
    enable = mkEnableOption "agentsandbox: one policy for AI coding agents (egress proxy, host broker, token keepers) as a systemd user service";

    package = mkOption {
      type = types.package;
      default = pkgs.agentsandbox or (pkgs.callPackage ./package.nix { });
      defaultText = lib.literalExpression "pkgs.agentsandbox or (pkgs.callPackage ./package.nix { })";
      description = "The agentsandbox package. It runs the service; the activation names its `install` when the machine has no drop-in.";
    };

    settings = settingsLib.option {
      inherit tomlFormat;
      machine = false;
      description = ''
        Written to {file}`$XDG_CONFIG_HOME/agentsandbox/config.toml`. On a machine with
        {file}`/etc/agentsandbox/config.toml` (the NixOS module's, the .deb's) that file bounds
        this one: these settings can only narrow it, and set what is this user's by nature
        (inject rules, broker commands); a wish it does not grant is left out with a notice
        (`agentsandbox doctor` shows each). They reach this user's Claude Code sessions through
        the policy helper the machine's drop-in names, and their hook, proxy and `run` directly.
        See docs/config.md for every key. The file is in the world-readable Nix store: name
        token sources, never tokens.
      '';
    };

    path = mkOption {
      type = types.listOf types.package;
      default = with pkgs; [
        git
        gnupg
        openssh
        gh
      ];
      defaultText = lib.literalExpression "with pkgs; [ git gnupg openssh gh ]";
      description = ''
        Programs the service runs (git, gpg and ssh-keygen for signing, gh for the built-in
        GitHub token rule), ahead of the profile directories on its `PATH`.
      '';
    };

    git.signing = mkOption {
      type = types.bool;
      default = false;
      description = ''
        Set git's `gpg.program` and `gpg.ssh.program` (through `programs.git`) to the
        package's signing wrappers: inside a sandbox they sign through the broker, outside it
        they run the real gpg / ssh-keygen.
      '';
    };
  };

  config = mkIf cfg.enable (
    lib.mkMerge [
      {
        assertions = [
          (lib.hm.assertions.assertPlatform "services.agentsandbox" pkgs lib.platforms.linux)
        ]
        ++ map (why: {
          assertion = false;
          message = "services.agentsandbox.settings: ${why} (agentsandbox's config loader refuses this)";
        }) (settingsLib.errors { inherit settings home; });

        warnings =
          map (
            key: "services.agentsandbox.settings.${key} is not a key this module knows; agentsandbox's config loader refuses unknown keys (the config file's build will fail on it unless the package is newer than this module)"
          ) (settingsLib.unknownKeys settings)
          ++ lib.optional (cfg.git.signing && !(config.programs.git.enable or false)) "services.agentsandbox.git.signing sets programs.git's config, which has no effect while programs.git.enable is false";

        home.packages = [ cfg.package ];

        xdg.configFile."agentsandbox/config.toml".source = configFile;

        # The machine's drop-in is root's (rendered from the machine's config,
        # never this user's); this user's config reaches their sessions through
        # the policy helper it names.  Check both are there; say the one root
        # command when not.
        home.activation.agentsandboxDropIn = lib.hm.dag.entryAfter [ "linkGeneration" ] ''
          agentsandboxWhy=""
          if [ ! -e ${managedTarget} ]; then
            agentsandboxWhy="${managedTarget} is not installed"
          elif ! agentsandboxHelper=$(${jq} -er '.policyHelper.path | strings' ${managedTarget} 2>/dev/null); then
            agentsandboxWhy="${managedTarget} names no policy helper (it predates the helper, or is not agentsandbox's)"
          elif [ ! -x "$agentsandboxHelper" ]; then
            agentsandboxWhy="${managedTarget} names the policy helper $agentsandboxHelper, which is not there (a collected store path?), so Claude Code does not start"
          elif [ ! -e ${managedBase} ]; then
            agentsandboxWhy="${managedBase} is missing, so Claude Code reads no drop-in"
          fi
          if [ -n "$agentsandboxWhy" ]; then
            echo "agentsandbox: $agentsandboxWhy. Root renders the machine's drop-in from /etc/agentsandbox/config.toml (or the built-in defaults without one), never from your file:"
            echo "  ${installCommand}"
            echo "agentsandbox: your own ${configTarget} then reaches your Claude Code sessions through the policy helper the drop-in names."
          fi
          unset agentsandboxWhy agentsandboxHelper
        '';

        systemd.user.services.agentsandbox = {
          Unit = lib.mapAttrs (_: subst) shipped.Unit // {
            # [broker] and [scope] changes need a restart; the rest reloads live.
            X-Restart-Triggers = [ "${configFile}" ];
          };
          Service = lib.mapAttrs (_: subst) (removeAttrs shipped.Service [ "Environment" ]) // {
            Environment = toList shipped.Service.Environment ++ [ "PATH=${servicePath}" ];
          };
          # home-manager wants the [Install] keys as lists.
          Install = lib.mapAttrs (_: toList) shipped.Install;
        };
      }
      (mkIf cfg.git.signing (optionalAttrs (options ? programs.git) {
        programs.git.${gitSettingsOption} = signing;
      }))
    ]
  );
}
