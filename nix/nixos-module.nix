# services.agentsandbox for NixOS: the machine's policy in /etc, the Claude Code
# drop-in rendered from it (naming the package's policy helper, which gives
# each session its own user's policy), the dispatcher that gives every user
# the one proxy port, and the per-user service in every user's systemd manager.
{
  config,
  lib,
  pkgs,
  ...
}:
let
  inherit (lib)
    mkEnableOption
    mkIf
    mkOption
    mkDefault
    mkForce
    types
    toList
    optionalAttrs
    ;

  cfg = config.services.agentsandbox;
  settingsLib = import ./settings.nix { inherit lib; };
  units = import ./units.nix { inherit lib; };
  tomlFormat = pkgs.formats.toml { };

  settings = settingsLib.clean cfg.settings;
  configFile = tomlFormat.generate "agentsandbox-config.toml" settings;
  dropIn = import ./dropin.nix {
    inherit (pkgs) runCommand;
    package = cfg.package;
  } { config = configFile; };

  # The contract's default (paths.DISPATCH_SOCKET); proxy.dispatch_socket moves it.
  dispatchSocket = settings.proxy.dispatch_socket or "/run/agentsandbox/dispatch.sock";
  port = toString settings.proxy.port;

  subst = units.substitute {
    package = cfg.package;
    kill = "${pkgs.coreutils}/bin/kill";
  };
  substAll = lib.mapAttrs (_: subst);

  # systemd's own keys that NixOS models as options of their own.
  unitOf =
    unit:
    let
      u = unit.Unit;
    in
    {
      description = u.Description;
      unitConfig = substAll (removeAttrs u [
        "Description"
        "Documentation"
        "Requires"
        "After"
      ]);
    }
    // optionalAttrs (u ? Documentation) { documentation = toList (subst u.Documentation); }
    // optionalAttrs (u ? Requires) { requires = toList u.Requires; }
    // optionalAttrs (u ? After) { after = toList u.After; }
    // optionalAttrs (unit ? Install && unit.Install ? WantedBy) { wantedBy = toList unit.Install.WantedBy; };

  serviceOf =
    unit:
    unitOf unit
    // {
      environment = units.environment (unit.Service.Environment or [ ]);
      serviceConfig = substAll (removeAttrs unit.Service [ "Environment" ]);
    };

  # The shipped socket's ListenStream= lines with this machine's port and path.
  listenStreams = map (
    s:
    if s == "/run/agentsandbox/dispatch.sock" then
      dispatchSocket
    else
      let
        m = builtins.match "(.*):3190" s;
      in
      if m == null then s else "${builtins.head m}:${port}"
  ) (toList units.dispatchSocket.Socket.ListenStream);

  errors = settingsLib.errors {
    settings = cfg.settings;
    home = "~";
  };
in
{
  options.services.agentsandbox = {
    enable = mkEnableOption "agentsandbox: one policy for AI coding agents (Claude Code drop-in, file-tool hook, egress proxy, host broker) for every user";

    package = mkOption {
      type = types.package;
      default = pkgs.agentsandbox or (pkgs.callPackage ./package.nix { });
      defaultText = lib.literalExpression "pkgs.agentsandbox or (pkgs.callPackage ./package.nix { })";
      description = "The agentsandbox package. Its renderer renders the drop-in, which names its policy helper; its units run the services.";
    };

    settings = settingsLib.option {
      inherit tomlFormat;
      description = ''
        The machine's agentsandbox config, written to {file}`/etc/agentsandbox/config.toml`,
        and the one file the Claude Code drop-in is rendered from. It bounds every user's: a
        user's own {file}`~/.config/agentsandbox/config.toml` can only narrow it (and set what
        is theirs by nature, such as their inject rules), and reaches their sessions through
        the policy helper the drop-in names. See docs/config.md for every key. The file is in
        the world-readable Nix store: name token sources (`token_command`, `token_file`,
        `token_env`), never tokens.
      '';
    };

    users = mkOption {
      type = types.listOf types.str;
      default = [ ];
      example = [
        "alice"
        "bob"
      ];
      description = ''
        Users whose systemd user manager starts the agentsandbox service. Empty: every user.
        The unit is installed for everyone either way; for others `ConditionUser=` skips it.
      '';
    };

    dispatcher.enable = mkOption {
      type = types.bool;
      default = true;
      description = ''
        Run the system dispatcher (socket-activated, `DynamicUser`): it owns the proxy port
        on 127.0.0.1 and ::1 and hands each connection to the service of the user who made it.
        Without it, only one user's service can bind the port the drop-in names.
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
        Programs the user service runs (git's config, gpg and ssh-keygen for signing, gh for
        the built-in GitHub token rule). The user's own profile directories follow them on
        `PATH`, for token commands and named host commands.
      '';
    };

    gitSigning = mkOption {
      type = types.bool;
      default = false;
      description = ''
        Point the system git config's `gpg.program` and `gpg.ssh.program` at the package's
        signing wrappers (`agentsandbox-gpg`, `agentsandbox-ssh-sign`): inside a sandbox they
        sign through the broker, outside it they run the real gpg / ssh-keygen.
      '';
    };
  };

  config = mkIf cfg.enable {
    assertions =
      map (why: {
        assertion = false;
        message = "services.agentsandbox.settings: ${why} (agentsandbox's config loader refuses this)";
      }) errors
      ++ [
        {
          assertion = !(cfg.dispatcher.enable && settings.proxy.dispatch_socket or null == "");
          message = "services.agentsandbox: the dispatcher is enabled but settings.proxy.dispatch_socket is \"\", so no user's service would register with it; drop the setting or set dispatcher.enable = false";
        }
      ];

    warnings = map (
      key: "services.agentsandbox.settings.${key} is not a key this module knows; agentsandbox's config loader refuses unknown keys (the drop-in's build will fail on it unless the package is newer than this module)"
    ) (settingsLib.unknownKeys settings);

    # The package in the system profile also puts the signing wrappers on PATH.
    environment.systemPackages = [ cfg.package ];

    environment.etc."agentsandbox/config.toml".source = configFile;
    # Rendered from the file above alone; it names ${package}/bin/agentsandbox-policy-helper.
    environment.etc."claude-code/managed-settings.d/50-agentsandbox.json".source = dropIn;
    # `agentsandbox install` creates the base file when it is missing; so does this.
    environment.etc."claude-code/managed-settings.json".text = mkDefault "{}\n";

    systemd.sockets.agentsandbox-dispatch = mkIf cfg.dispatcher.enable (
      unitOf units.dispatchSocket
      // {
        inherit listenStreams;
        socketConfig = removeAttrs units.dispatchSocket.Socket [ "ListenStream" ];
      }
    );

    systemd.services.agentsandbox-dispatch = mkIf cfg.dispatcher.enable (serviceOf units.dispatchService);

    systemd.user.services.agentsandbox =
      let
        base = serviceOf units.userService;
      in
      base
      // {
        unitConfig =
          base.unitConfig // optionalAttrs (cfg.users != [ ]) { ConditionUser = map (u: "|${u}") cfg.users; };
        environment = base.environment // {
          PATH = mkForce (
            lib.concatStringsSep ":" [
              (lib.makeBinPath cfg.path)
              "/run/wrappers/bin"
              "/etc/profiles/per-user/%u/bin"
              "/run/current-system/sw/bin"
            ]
          );
        };
      };

    programs.git = mkIf cfg.gitSigning {
      enable = mkDefault true;
      config.gpg = {
        program = "${cfg.package}/bin/agentsandbox-gpg";
        ssh.program = "${cfg.package}/bin/agentsandbox-ssh-sign";
      };
    };
  };
}
