; Inno Setup script: Setup.exe for Checkpoint Chat (Windows 10/11, x64).  Needs Inno Setup
; 6.3 or newer (the x64compatible architecture identifier).
;
; Build the one-folder app first, then compile this script:
;   pyinstaller --noconfirm --distpath dist --workpath build\pyinstaller installer\checkpoint_chat.spec
;   "C:\Program Files (x86)\Inno Setup 6\ISCC.exe" installer\checkpoint_chat.iss
;
; A signed release (unsigned programs meet SmartScreen warnings and Smart App Control
; blocks): define Sign and give ISCC a sign tool named "signtool"; it then signs both
; executables, Setup.exe and the uninstaller, e.g.
;   ISCC /DSign "/Ssigntool=$qC:\Program Files (x86)\Windows Kits\10\bin\10.0.26100.0\x64\signtool.exe$q sign /fd sha256 /tr http://timestamp.digicert.com /td sha256 /a $f" installer\checkpoint_chat.iss
;
; Installs per user by default (no administrator rights; the user may choose "all users"),
; adds a Start menu entry, and associates .kvckpt files with the windowed app: a
; double-click runs `CheckpointChat.exe "<file>"`, which offers to resume it.
; Uninstalling removes the program folder and the association only: checkpoints,
; settings and logs in %LOCALAPPDATA%\CheckpointChat (platformdirs) stay.
; An upgrade first deletes the old {app}\_internal (see [InstallDelete]): PyInstaller's
; folder of DLLs and .pyd files, where a file the new version no longer ships would
; otherwise stay and could be loaded; and any DLL or .pyd in {app} itself.  A running Checkpoint Chat is asked to close
; through the Restart Manager (CloseApplications, Inno's default): the app then pauses
; and saves as at sign-out (gui/session_end.py).

#if VER < EncodeVer(6,3,0)
  #error Inno Setup 6.3 or newer is needed (x64compatible, ArchitecturesInstallIn64BitMode)
#endif

#define AppName "Checkpoint Chat"
#define AppVersion "0.1.0"
#define AppExe "CheckpointChat.exe"
#define CliExe "checkpoint-chat.exe"
#define ProgId "CheckpointChat.Checkpoint"
#define Ext ".kvckpt"
#define MimeType "application/x-kvckpt"

[Setup]
AppId={{6C0E5B0A-3D1F-4C8E-9A57-2F4B7D1C9E21}
AppName={#AppName}
AppVersion={#AppVersion}
VersionInfoVersion={#AppVersion}
VersionInfoProductName={#AppName}
AppPublisher=Checkpoint Chat
DefaultDirName={autopf}\{#AppName}
DefaultGroupName={#AppName}
DisableProgramGroupPage=yes
PrivilegesRequired=lowest
PrivilegesRequiredOverridesAllowed=dialog
ArchitecturesAllowed=x64compatible
ArchitecturesInstallIn64BitMode=x64compatible
MinVersion=10.0
ChangesAssociations=yes
UninstallDisplayIcon={app}\{#AppExe}
SetupIconFile=..\resources\checkpoint-chat.ico
CloseApplications=yes
#ifdef Sign
SignTool=signtool
SignedUninstaller=yes
  #define SignFlag "signonce"
#else
  #define SignFlag ""
#endif
OutputDir=..\dist
OutputBaseFilename=CheckpointChat-{#AppVersion}-Setup
Compression=lzma2/max
SolidCompression=yes
WizardStyle=modern

[InstallDelete]
; the previous version's libraries: stale DLLs and .pyd files must not survive an upgrade
Type: filesandordirs; Name: "{app}\_internal"
; and what a build of another layout (PyInstaller before 6 put every library beside the
; executables) left in the program folder itself; the uninstaller's unins000.* stay
Type: files; Name: "{app}\*.dll"
Type: files; Name: "{app}\*.pyd"
Type: files; Name: "{app}\base_library.zip"

[Files]
Source: "..\dist\CheckpointChat\{#AppExe}"; DestDir: "{app}"; Flags: ignoreversion {#SignFlag}
Source: "..\dist\CheckpointChat\{#CliExe}"; DestDir: "{app}"; Flags: ignoreversion {#SignFlag}
Source: "..\dist\CheckpointChat\*"; Excludes: "\{#AppExe},\{#CliExe}"; DestDir: "{app}"; Flags: ignoreversion recursesubdirs createallsubdirs

[Icons]
Name: "{group}\{#AppName}"; Filename: "{app}\{#AppExe}"
Name: "{autodesktop}\{#AppName}"; Filename: "{app}\{#AppExe}"; Tasks: desktopicon

[Tasks]
Name: "desktopicon"; Description: "{cm:CreateDesktopIcon}"; GroupDescription: "{cm:AdditionalIcons}"; Flags: unchecked

[Registry]
; HKA = HKCU for a per-user install, HKLM for all users.  Every value we write is removed
; on uninstall, and a key we created goes with it once empty (another program may have
; put its own values under .kvckpt: those, and the key, then stay).
Root: HKA; Subkey: "Software\Classes\{#Ext}"; ValueType: string; ValueName: ""; ValueData: "{#ProgId}"; Flags: uninsdeletevalue uninsdeletekeyifempty
Root: HKA; Subkey: "Software\Classes\{#Ext}"; ValueType: string; ValueName: "Content Type"; ValueData: "{#MimeType}"; Flags: uninsdeletevalue uninsdeletekeyifempty
Root: HKA; Subkey: "Software\Classes\{#Ext}\OpenWithProgids"; ValueType: string; ValueName: "{#ProgId}"; ValueData: ""; Flags: uninsdeletevalue uninsdeletekeyifempty
Root: HKA; Subkey: "Software\Classes\{#ProgId}"; ValueType: string; ValueName: ""; ValueData: "Checkpoint Chat checkpoint"; Flags: uninsdeletekey
Root: HKA; Subkey: "Software\Classes\{#ProgId}\DefaultIcon"; ValueType: string; ValueName: ""; ValueData: "{app}\{#AppExe},0"
Root: HKA; Subkey: "Software\Classes\{#ProgId}\shell\open\command"; ValueType: string; ValueName: ""; ValueData: """{app}\{#AppExe}"" ""%1"""
Root: HKA; Subkey: "Software\Classes\Applications\{#AppExe}"; ValueType: string; ValueName: "FriendlyAppName"; ValueData: "{#AppName}"; Flags: uninsdeletekey
Root: HKA; Subkey: "Software\Classes\Applications\{#AppExe}\DefaultIcon"; ValueType: string; ValueName: ""; ValueData: "{app}\{#AppExe},0"
Root: HKA; Subkey: "Software\Classes\Applications\{#AppExe}\shell\open\command"; ValueType: string; ValueName: ""; ValueData: """{app}\{#AppExe}"" ""%1"""
Root: HKA; Subkey: "Software\Classes\Applications\{#AppExe}\SupportedTypes"; ValueType: string; ValueName: "{#Ext}"; ValueData: ""

[Run]
Filename: "{app}\{#AppExe}"; Description: "{cm:LaunchProgram,{#AppName}}"; Flags: nowait postinstall skipifsilent

; No [UninstallDelete] entry for user data, on purpose: %LOCALAPPDATA%\CheckpointChat
; holds the user's checkpoints.  Only files the installer wrote are removed.

[Messages]
UninstalledAll=%1 was removed. Your checkpoints and settings were kept in %LOCALAPPDATA%\CheckpointChat; delete that folder yourself if you no longer need them.
